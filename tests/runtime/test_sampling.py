"""Sampling draws from softmax(logits / T), and a seeded draw is a function of (seed, index)."""

from __future__ import annotations

import numpy as np
import torch

from ray_attn.runtime.sampling import hash_uniform, sample


def test_hash_uniform_is_uniform_and_keyed():
    u = hash_uniform(torch.tensor([1, 2, 3]), torch.tensor([0, 0, 5]), 20_000)
    assert u.shape == (3, 20_000) and 0 < u.min() and u.max() < 1
    # Mean 1/2 and variance 1/12 each within ~5 standard errors for 20k draws.
    assert abs(u.mean().item() - 0.5) < 5 * (1 / 12 / 60_000) ** 0.5
    assert abs(u.var().item() - 1 / 12) < 0.002
    again = hash_uniform(torch.tensor([3, 1]), torch.tensor([5, 0]), 20_000)
    assert torch.equal(again[0], u[2]) and torch.equal(again[1], u[0])
    assert not torch.equal(u[0], u[1])  # seeds 1 and 2 differ
    assert not torch.equal(hash_uniform(torch.tensor([1]), torch.tensor([1]), 100)[0], u[0, :100])


def test_a_seeded_draw_never_takes_a_filtered_token():
    """Seed 1234 at index 2657 hashes column 730 to the largest value the hash makes.  When that
    mapped to u = 1.0 exactly (24 bits in float32), the column's Gumbel score was +inf, or NaN
    where it was filtered out (-inf), and argmax took it anyway: masked and top-k tokens leaked."""
    seeds, idx = torch.tensor([1234]), torch.tensor([2657])
    u = hash_uniform(seeds, idx, 1000)
    assert u.max() < 1 and u.argmax() == 730
    logits = torch.zeros(1, 1000)
    logits[0, 730] = float("-inf")
    tok = sample(logits, np.ones(1, np.float32), np.array([1234], np.int64), np.array([2657], np.int32))
    assert tok[0] != 730


def test_seeded_draws_follow_softmax():
    """Many seeded draws (one per index) against the exact distribution: chi-square."""
    gen = torch.Generator().manual_seed(0)
    V, T, N = 12, 0.7, 6000
    logits = torch.randn(1, V, generator=gen) * 0.5  # every cell expects >= ~100 draws
    p = torch.softmax(logits[0].double() / T, -1).numpy()
    counts = np.zeros(V)
    batch = 500
    for start in range(0, N, batch):
        idx = np.arange(start, start + batch, dtype=np.int32)
        toks = sample(logits.expand(batch, V).contiguous(), np.full(batch, T, np.float32),
                      np.full(batch, 1234, np.int64), idx)
        counts += np.bincount(toks, minlength=V)
    chi2 = ((counts - N * p) ** 2 / (N * p)).sum()
    assert chi2 < 40, (chi2, counts, N * p)  # 11 dof: P(chi2 > 40) ~ 3e-5


def test_seeded_draw_ignores_batch_neighbours_and_greedy_is_argmax():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 50, generator=gen)
    temps = np.array([0.0, 1.0, 1.0, 0.5], np.float32)
    seeds = np.array([-1, 7, -1, 9], np.int64)
    idx = np.array([0, 3, 0, 4], np.int32)
    toks = sample(logits, temps, seeds, idx, torch.Generator().manual_seed(2))
    assert toks[0] == logits[0].argmax()
    alone = sample(logits[1:2], temps[1:2], seeds[1:2], idx[1:2])
    assert alone[0] == toks[1]
    other = sample(logits[3:4], temps[3:4], seeds[3:4], idx[3:4] + 1)
    draws = {int(sample(logits[3:4], temps[3:4], seeds[3:4], np.array([k], np.int32))[0]) for k in range(40)}
    assert len(draws) > 1 and other.shape == (1,)  # the index moves the draw


def test_seed_zero_is_a_seed(rng):
    """Seed 0 draws from the hash like any other seed (only -1 means "no seed"), so the rank's
    generator cannot move its tokens."""
    R, V = 32, 1000
    logits = torch.randn(R, V, generator=rng)
    temps, idx, zero = np.ones(R, np.float32), np.arange(R, dtype=np.int32), np.zeros(R, np.int64)
    a = sample(logits, temps, zero, idx, torch.Generator().manual_seed(1))
    b = sample(logits, temps, zero, idx, torch.Generator().manual_seed(2))
    # Temperature 1 keeps the expected draw to the very ops the sampler runs: equal bit for bit.
    u = hash_uniform(torch.zeros(R, dtype=torch.int64), torch.from_numpy(idx).long(), V)
    expected = (logits - torch.log(-torch.log(u))).argmax(-1).numpy()
    assert np.array_equal(a, expected) and np.array_equal(b, expected)
    assert not np.array_equal(a, sample(logits, temps, zero + 1, idx))
