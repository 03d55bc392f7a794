"""Batched LoRA (ray_attn/lora/punica.py): the torch reference against a float64 per-token loop,
and the Triton shrink/expand kernels against it -- under Triton's interpreter on CPU (this module
again, in a subprocess), in bf16 on a GPU.

Tolerances: float32 sums of K <= 192 and R <= 32 unit-size terms differ from float64 by ~1e-6:
1e-4 catches a token given another slot's weights, a part read from the wrong columns of S, a
dropped tail block or a base token touched.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ray_attn.lora import punica as P
from tests.interpreter import INTERPRETED, kernels_run_here, run_module_interpreted

# (tokens, K, parts' rows, rank R, slots): a fused q/k/v (three parts), a two-part gate/up, a
# single projection; ragged K and token counts, slots left empty, every token an adapter's.
CASES = [(37, 70, (32, 16, 16), 16, 3), (5, 192, (64, 64), 32, 4), (64, 48, (48,), 16, 8), (1, 64, (16,), 16, 2)]
# decode-sized steps over a long K: the shrink splits K into 2 and 4 slices (the last one ragged)
SPLIT_CASES = [(5, 1100, (32, 16), 16, 3), (40, 2100, (48,), 16, 2)]


def inputs(T, K, rows, R, L, dtype=torch.float32, device="cpu", seed=0, base_share=0.3):
    g = torch.Generator().manual_seed(seed + T + K)
    N = sum(rows)
    x = torch.randn(T, K, generator=g)
    y = torch.randn(T, N, generator=g)
    a = torch.randn(L, len(rows) * R, K, generator=g) * K ** -0.5
    b = torch.randn(L, N, R, generator=g) * R ** -0.5
    rng = np.random.default_rng(seed)
    slots = rng.integers(0, L, T)
    slots[rng.random(T) < base_share] = -1
    offsets = tuple(int(o) for o in np.cumsum((0,) + rows[:-1]))
    to = dict(dtype=dtype, device=device)
    return x.to(**to), y.to(**to), a.to(**to), b.to(**to), offsets, slots.astype(np.int32)


def float64_loop(x, y, a, b, offsets, R, slots, magnitude=False):
    """Per token: y[t] + B[s]_p (A[s]_p x[t]) for every part p, in float64.  ``magnitude``: instead
    the update's sum of absolute terms, |B[s]_p| |A[s]_p x[t]| (what rounding S scales with)."""
    out = torch.zeros_like(y, dtype=torch.float64) if magnitude else y.double().clone()
    bounds = list(offsets) + [y.shape[1]]
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        for p in range(len(offsets)):
            lo, hi = bounds[p], bounds[p + 1]
            sh = a[s, p * R:(p + 1) * R].double() @ x[t].double()
            bs = b[s, lo:hi].double()
            out[t, lo:hi] += bs.abs() @ sh.abs() if magnitude else bs @ sh
    return out


def test_step_meta_sorts_tokens_by_slot_and_leaves_base_out():
    order, start = P.step_meta(np.array([2, -1, 0, 2, -1, 0, 1], np.int32), 4)
    assert order.tolist() == [2, 5, 6, 0, 3] and start.tolist() == [0, 2, 3, 5, 5]


@pytest.mark.parametrize("case", CASES)
def test_reference_matches_float64(case):
    T, K, rows, R, L = case
    x, y, a, b, offsets, slots = inputs(T, K, rows, R, L)
    got = P.lora_reference(x, y.clone(), a, b, offsets, R, torch.from_numpy(slots))
    want = float64_loop(x, y, a, b, offsets, R, slots)
    assert (got.double() - want).abs().max() < 1e-4
    base = slots < 0
    assert torch.equal(got[torch.from_numpy(base)], y[torch.from_numpy(base)])  # base rows untouched


def test_expand_block_never_straddles_a_part():
    assert P.expand_block((4096, 5120)) == 64 and P.expand_block((32, 48)) == 16 and P.expand_block((40,)) is None


def test_split_k_splits_decode_steps_over_long_k_only():
    assert [P.split_k(T, K) for T, K, *_ in SPLIT_CASES] == [2, 4]
    assert P.split_k(64, 14336) == 28 and P.split_k(1, 1 << 16) == P.tuning.DEFAULT.max_split
    assert P.split_k(65, 14336) == 1 and P.split_k(1, 511) == 1
    wide = P.KernelConfig(split_min_k=128, max_split=64, block_k=128)
    assert P.split_k(1, 4096, wide) == 32 and P.split_k(1, 14336, wide) == P.MAX_SPLIT
    assert all(P.split_k(T, K) == 1 for T, K, *_ in CASES)


def test_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    if kernels_run_here():
        pytest.skip("the kernels' own tests run in this process")
    run_module_interpreted(__file__, min_passed=len(CASES) + len(SPLIT_CASES) + 3 * len(CONFIGS))


@pytest.mark.parametrize("case", CASES + SPLIT_CASES)
def test_triton_matches_reference(case):
    pytest.importorskip("triton")
    if not INTERPRETED:
        pytest.skip("run with TRITON_INTERPRET=1 (or on a GPU: the bf16 test)")
    T, K, rows, R, L = case
    x, y, a, b, offsets, slots = inputs(T, K, rows, R, L)
    order, start = P.step_meta(slots, L)
    got = P.lora_triton(x, y.clone(), a, b, offsets, R, torch.from_numpy(order), torch.from_numpy(start))
    want = float64_loop(x, y, a, b, offsets, R, slots)
    assert (got.double() - want).abs().max() < 1e-4


# launch settings the tuner may pick: the fused kernel (small and large K tiles), and a wide split
CONFIGS = [P.KernelConfig(fused=True, block_k=64, block_n=32), P.KernelConfig(fused=True, block_k=256, block_n=128),
           P.KernelConfig(split_min_k=128, max_split=64, block_k=128, block_n=128, num_warps=2, num_stages=2)]


@pytest.mark.parametrize("config", CONFIGS, ids=["fused_k64", "fused_k256", "split128"])
@pytest.mark.parametrize("case", [(70, 130, (32, 16, 16), 16, 3), CASES[1], SPLIT_CASES[0]])
def test_triton_configs_match_reference(case, config):
    """Every setting computes the same update (a fused kernel that read another part's A rows, or
    skipped a slot's tokens past its first 16 -- the first case has ~21 a slot -- would not)."""""
    pytest.importorskip("triton")
    if not INTERPRETED:
        pytest.skip("run with TRITON_INTERPRET=1 (or on a GPU: the bf16 test)")
    T, K, rows, R, L = case
    x, y, a, b, offsets, slots = inputs(T, K, rows, R, L, base_share=0.1)
    order, start = P.step_meta(slots, L)
    got = P.lora_triton(x, y.clone(), a, b, offsets, R, torch.from_numpy(order), torch.from_numpy(start),
                        config=config)
    want = float64_loop(x, y, a, b, offsets, R, slots)
    assert (got.double() - want).abs().max() < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None] + CONFIGS)
@pytest.mark.parametrize("case", CASES + SPLIT_CASES + [(64, 4096, (4096, 1024, 1024), 16, 8), (1, 14336, (4096,), 16, 8),
                                  (65, 4096, (4096, 1024, 1024), 16, 8)])
def test_gpu_bf16_matches_float64(case, config):
    """bf16 in and out, float32 accumulation: S is rounded to bf16 once before the expand (as
    vLLM's expand does; 2^-8 of each |B_r S_r| term) and y once after the add (2^-8 of |y'|), so
    |err| <= 2^-8 (sum_r |B_r| |S_r| + |y'|), with 5% and 1e-4 for the float32 sums.  The bound is
    on the terms, not on |update|: under cancellation the update is far smaller than its terms."""
    T, K, rows, R, L = case
    x, y, a, b, offsets, slots = inputs(T, K, rows, R, L, torch.bfloat16, "cuda")
    order, start = P.step_meta(slots, L)
    got = P.lora_triton(x, y.clone(), a, b, offsets, R, torch.from_numpy(order).cuda(), torch.from_numpy(start).cuda(),
                        config=config)
    want = float64_loop(x.cpu(), y.cpu(), a.cpu(), b.cpu(), offsets, R, slots)
    terms = float64_loop(x.cpu(), y.cpu(), a.cpu(), b.cpu(), offsets, R, slots, magnitude=True)
    tol = 1.05 * 2 ** -8 * (terms + want.abs()) + 1e-4
    assert ((got.cpu().double() - want).abs() <= tol).all()
