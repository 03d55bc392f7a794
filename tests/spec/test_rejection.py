"""Rank 0's rejection sampler (runtime/spec_decode.py) at the sampler level: which tokens a
speculating row emits, and that at temperature > 0 the emitted sequences follow the target's
distribution exactly -- a chi-square over many seeds against the exact law and against the
non-speculative sampler, which an eager sampler fails."""

from __future__ import annotations

import numpy as np
import torch

from ray_attn.runtime.messages import SamplingInputs, SpecDecodeInputs
from ray_attn.runtime.sampling import SamplingTensors, sample, sample_on_device
from ray_attn.runtime.spec_decode import accepted_tokens, reject_drafts, spec_layout


def test_layout_names_each_rows_first_logits_row_and_each_drafts_verifier():
    seg_first, verify = spec_layout(np.array([2, 0, 3]))
    assert seg_first.tolist() == [0, 0, 0, 3, 4, 4, 4, 4]
    assert verify.tolist() == [0, 1, 4, 5, 6]  # draft j of a row is checked at the position before it


def test_greedy_keeps_drafts_up_to_the_first_mismatch_and_the_targets_token_there():
    # rows: 3 drafts all right (+ bonus); 2 drafts, the first wrong; no drafts; 2 drafts, the second wrong
    target = torch.tensor([5, 6, 7, 8, 1, 2, 3, 9, 4, 0, 3], dtype=torch.int32)
    k = np.array([3, 2, 0, 2])
    drafts = torch.tensor([5, 6, 7, 9, 2, 4, 1])
    seg_first, verify = spec_layout(k)
    out = reject_drafts(target, torch.from_numpy(verify), drafts, torch.from_numpy(seg_first))
    assert out.tolist() == [5, 6, 7, 8, 1, -1, -1, 9, 4, 0, -1]
    assert accepted_tokens(out.numpy(), k) == [[5, 6, 7, 8], [1], [9], [4, 0]]


# -- the distribution ----------------------------------------------------------------------------
V, K = 6, 2
LOGITS = torch.tensor([[0.2, 1.0, -0.5, 0.3, 0.0, 0.4],    # at t: predicts the token after it
                       [0.5, -0.2, 0.1, 1.1, 0.3, -1.0],   # at d1 (as if d1 were accepted)
                       [-0.3, 0.6, 0.2, 0.0, 0.9, 0.1]])   # at d2: the bonus position
DRAFTS = [1, 3]
TEMP = 0.8


def exact_law() -> dict[tuple, float]:
    """The law of what one step emits when the target samples sequentially: y0 ~ p0; if y0 is
    the draft d1 the next token y1 ~ p1 (the logits there assume d1), and so on; the step ends
    at the first token that differs from its draft, or after the bonus token."""
    p = torch.softmax(LOGITS.double() / TEMP, -1).numpy()
    law = {}
    for v in range(V):
        if v != DRAFTS[0]:
            law[(v,)] = p[0, v]
    for v in range(V):
        if v != DRAFTS[1]:
            law[(DRAFTS[0], v)] = p[0, DRAFTS[0]] * p[1, v]
    for v in range(V):
        law[(DRAFTS[0], DRAFTS[1], v)] = p[0, DRAFTS[0]] * p[1, DRAFTS[1]] * p[2, v]
    return law


def speculative_steps(seeds: np.ndarray | None, first_index: int = 0, n: int = 0) -> list[tuple]:
    """One speculative step per seed (a row each, 1 + K logits rows): its emitted tokens.
    ``seeds`` None: ``n`` unseeded rows (the rank's generator)."""
    n = len(seeds) if seeds is not None else n
    k = np.full(n, K, np.int32)
    spec = SpecDecodeInputs(k, np.tile(np.array(DRAFTS, np.int32), n), np.arange(n * (K + 1), dtype=np.int32))
    R = n * (K + 1)
    s = np.repeat(seeds, K + 1) if seeds is not None else np.full(R, -1, np.int64)
    index = np.tile(np.arange(K + 1, dtype=np.int32), n) + first_index
    st = SamplingTensors.stage(np.full(R, TEMP, np.float32), s.astype(np.int64), index, torch.device("cpu"),
                               spec=spec)
    toks, _ = sample_on_device(LOGITS.repeat(n, 1), st, torch.Generator().manual_seed(11))
    return [tuple(x) for x in accepted_tokens(toks.numpy(), k)]


def sequential_steps(seeds: np.ndarray, first_index: int = 0) -> list[tuple]:
    """The same steps through the non-speculative sampler: one token at a time, the next drawn
    only while the tokens so far equal the drafts (token index ``first_index + j``)."""
    out = []
    for seed in seeds.tolist():
        got = []
        for j in range(K + 1):
            tok = int(sample(LOGITS[j:j + 1], np.array([TEMP], np.float32), np.array([seed], np.int64),
                             np.array([first_index + j], np.int32))[0])
            got.append(tok)
            if j == K or tok != DRAFTS[j]:
                break
        out.append(tuple(got))
    return out


def chi_square(samples: list[tuple], law: dict[tuple, float]) -> float:
    """Pearson's statistic of ``samples`` against the exact ``law``."""
    assert set(samples) <= set(law), set(samples) - set(law)
    n = len(samples)
    counts = {c: 0 for c in law}
    for s in samples:
        counts[s] += 1
    return sum((counts[c] - n * p) ** 2 / (n * p) for c, p in law.items())


def two_sample_chi_square(a: list[tuple], b: list[tuple], cells) -> float:
    """Pearson's homogeneity statistic of two samples over ``cells`` (len(cells) - 1 dof)."""
    ca = np.array([a.count(c) for c in cells], float)
    cb = np.array([b.count(c) for c in cells], float)
    pooled = (ca + cb) / (len(a) + len(b))
    return float(((ca - len(a) * pooled) ** 2 / (len(a) * pooled)).sum()
                 + ((cb - len(b) * pooled) ** 2 / (len(b) * pooled)).sum())


def test_the_emitted_sequences_follow_the_targets_law():
    """16 outcomes (15 dof): P(chi2 > 45) ~ 8e-5.  Samplers that accept too eagerly land far
    above it: accepting every draft (chi2 ~ 1e5), accepting a draft whenever it is the target's
    mode (~1e5), or forgiving 5% of the mismatches (~116)."""
    law = exact_law()
    assert min(law.values()) * 20000 > 20  # every cell expects enough draws for the statistic
    seeded = speculative_steps(np.arange(20000, dtype=np.int64) * 7 + 3)
    assert chi_square(seeded, law) < 45
    assert chi_square(speculative_steps(None, n=10000), law) < 45


def test_a_seeded_step_emits_what_the_non_speculative_sampler_draws():
    """With the same (seed, token index) noise the speculative step and the one-token-at-a-time
    sampler emit the same tokens: seeded outputs do not depend on whether a step speculated."""
    seeds = np.arange(300, dtype=np.int64) * 13 + 1
    assert speculative_steps(seeds, first_index=17) == sequential_steps(seeds, first_index=17)
    # and against it as a distribution, over seeds the speculative run never saw (15 dof)
    spec = speculative_steps(np.arange(20000, dtype=np.int64))
    plain = sequential_steps(np.arange(20000, 23000, dtype=np.int64))
    assert two_sample_chi_square(spec, plain, list(exact_law())) < 45


def test_each_position_is_processed_with_its_own_history():
    """Penalties at draft position j see the drafts before it: a repetition penalty on the
    draft d1 lowers it at the positions after d1 only.  Greedy, so the emitted tokens are the
    processed argmaxes; checked against the float64 penalty applied by hand."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 0.0], [0.0, 3.0, 2.9, 0.0], [0.0, 0.0, 0.0, 5.0]])
    k = np.array([2], np.int32)
    spec = SpecDecodeInputs(k, np.array([1, 1], np.int32), np.arange(3, dtype=np.int32))
    # the row's history at each position: nothing, then d1 (=1), then d1 d2 (=1 1)
    si = SamplingInputs(penalty_rows=np.arange(3, dtype=np.int32), presence_penalty=np.zeros(3, np.float32),
                        frequency_penalty=np.zeros(3, np.float32), repetition_penalty=np.full(3, 1.5, np.float32),
                        history=np.array([1, 1, 1], np.int32), history_lens=np.array([0, 1, 2], np.int32))
    st = SamplingTensors.stage(np.zeros(3, np.float32), np.full(3, -1, np.int64), np.arange(3, dtype=np.int32),
                               torch.device("cpu"), inputs=si, spec=spec)
    toks, _ = sample_on_device(logits, st)
    # position 0: argmax 1 = d1 (accepted); position 1: 3.0 / 1.5 = 2.0 < 2.9, so 2 != d2 = 1
    assert accepted_tokens(toks.numpy(), k) == [[1, 2]]
