"""Rank 0's rejection sampler for speculative decoding: which of a row's draft tokens it keeps.

A speculating row r computed its last sampled token t and drafts d_1..d_k in one query, and has a
logits row at each of those k + 1 positions (``SpecDecodeInputs``).  The sampler first draws the
target's token y_j at every position j exactly as it draws any token -- the same processing
(penalties over the history up to that position, temperature, min-p, top-k/p) and, for seeded
rows, the same counter-based draw of token index ``sample_index + j`` -- as if d_1..d_j had been
accepted.  The row then emits y_0 .. y_a, where a is the first j with y_j != d_{j+1} (or k):
the accepted drafts, then the target's own token at the first mismatch, or the bonus token y_k
when every draft was accepted.

That is the exact rejection scheme for a proposer whose draft distribution is a point mass
(n-gram; a draft model's argmax): draft x at a position whose target distribution is p is
accepted with probability p(x) (= min(1, p(x)/q(x)) with q(x) = 1), and when rejected the token
emitted is y conditioned on y != x, i.e. p with x removed and renormalised -- the residual
(p - q)+ / sum (p - q)+.  Drawing y with the counter-based noise makes it a coupling with the
non-speculative sampler: with the same logits, a seeded request emits the very tokens it would
have without speculation, whatever its batch, its steps, k, or whether a step speculated.  Greedy
rows are the case without noise: y_j is the argmax.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ray_attn.backend.triton_ops import available

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - CPU machines without triton
    triton = None


def seg_starts(num_draft_tokens: np.ndarray) -> np.ndarray:
    """Each request's first logits row [B]: its 1 + k rows follow the earlier requests'."""
    seg_len = np.asarray(num_draft_tokens, np.int64) + 1
    return np.cumsum(seg_len) - seg_len


def spec_layout(num_draft_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ``num_draft_tokens`` [B]: per logits row (R = B + sum k of them, row after row), the
    first logits row of its request (``seg_first`` [R]); per draft token (D = sum k, row after
    row), the logits row that verifies it (``verify_rows`` [D]: the position before it)."""
    k = np.asarray(num_draft_tokens, np.int64)
    seg_start = seg_starts(k)
    seg_first = np.repeat(seg_start, k + 1)
    D = int(k.sum())
    verify_rows = np.repeat(seg_start, k) + np.arange(D) - np.repeat(np.cumsum(k) - k, k)
    return seg_first, verify_rows


@functools.lru_cache(maxsize=256)
def _layout_of(k_bytes: bytes) -> np.ndarray:
    k = np.frombuffer(k_bytes, np.int64)
    seg_first, verify_rows = spec_layout(k)
    out = np.concatenate([verify_rows, seg_first, seg_starts(k), k]).astype(np.int32)
    out.flags.writeable = False
    return out


def staged_layout(num_draft_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``spec_layout``'s (verify_rows, seg_first) with ``seg_starts`` and the counts, as int32
    views of one read-only array, kept for the layouts seen lately: a batch speculates with the
    same draft counts step after step (k, or what a row has room for), and this runs on the
    rank's critical path between two verifying steps."""
    k = np.asarray(num_draft_tokens, np.int64)
    flat = _layout_of(k.tobytes())
    B, D = len(k), int(k.sum())
    return flat[:D], flat[D:D + B + D], flat[B + 2 * D:2 * B + 2 * D], flat[2 * B + 2 * D:]


if triton is not None:

    @triton.jit
    def _reject_kernel(target_ptr, draft_ptr, seg_start_ptr, num_drafts_ptr, out_ptr, BLOCK: tl.constexpr):
        # One program a request: its 1 + k logits rows start at seg_start, its drafts at
        # seg_start - b (each earlier request has one logits row more than drafts).
        b = tl.program_id(0)
        s = tl.load(seg_start_ptr + b).to(tl.int64)
        k = tl.load(num_drafts_ptr + b)
        j = tl.arange(0, BLOCK)
        t = tl.load(target_ptr + s + j, mask=j <= k, other=0)
        d = tl.load(draft_ptr + (s - b) + j, mask=j < k, other=0)  # draft j + 1, verified at row j
        bad = ((t != d) & (j < k)).to(tl.int32)
        before = tl.cumsum(bad, 0) - bad  # mismatches at this request's earlier rows
        tl.store(out_ptr + s + j, tl.where(before == 0, t, -1), mask=j <= k)


def reject_drafts_launch(target: torch.Tensor, draft_ids: torch.Tensor, seg_start: torch.Tensor,
                         num_drafts: torch.Tensor, max_drafts: int) -> torch.Tensor:
    """``reject_drafts`` as one Triton kernel (a program a request): the torch formulation is ~11
    small launches, ~0.19 ms of host time a verifying step on an H200 host at batch 1 (a tenth of
    what verifying 4 drafts added to the step; ``scripts/bench_spec_verify.py --profile``)."""
    out = torch.empty_like(target)
    if len(num_drafts):
        _reject_kernel[(len(num_drafts),)](target, draft_ids, seg_start, num_drafts, out,
                                           BLOCK=triton.next_power_of_2(max_drafts + 1))
    return out


def reject_drafts(target: torch.Tensor, verify_rows: torch.Tensor, draft_ids: torch.Tensor,
                  seg_first: torch.Tensor, seg_start: torch.Tensor | None = None,
                  num_drafts: torch.Tensor | None = None, max_drafts: int = 0) -> torch.Tensor:
    """``target`` [R] int32, the target's token at every logits row, with -1 after each row's first
    mismatch: a row keeps its position j while every draft verified at positions < j matched.  No
    host sync (every shape is known on the host).  Given each request's first logits row and
    draft count (``seg_start``, ``num_drafts`` [B]), CUDA runs it as one kernel."""
    if seg_start is not None and target.is_cuda and available():
        return reject_drafts_launch(target, draft_ids, seg_start, num_drafts, max_drafts)
    bad = torch.zeros(len(target), dtype=torch.int32, device=target.device)
    bad[verify_rows] = (target[verify_rows].long() != draft_ids).to(torch.int32)
    before = torch.cumsum(bad, 0, dtype=torch.int32) - bad  # mismatches at earlier logits rows
    keep = before == before[seg_first]
    return torch.where(keep, target, torch.full_like(target, -1))


def accepted_tokens(token_ids: np.ndarray, num_draft_tokens: np.ndarray) -> list[list[int]]:
    """The driver's reading of a speculative step's answer: each row's emitted tokens (the
    leading non-negative ones of its 1 + k entries)."""
    out, start = [], 0
    flat = token_ids.tolist()
    for k in np.asarray(num_draft_tokens).tolist():
        seg = flat[start:start + k + 1]
        n = next((i for i, t in enumerate(seg) if t < 0), len(seg))
        out.append(seg[:n])
        start += k + 1
    return out


def check_spec_inputs(step) -> None:
    """Refuse a speculative step whose arrays disagree (``ValueError`` naming the field), before
    any of it reaches the device: an index past the step's tokens would fail there."""
    spec, m = step.spec, step.plan.attn
    k = np.asarray(spec.num_draft_tokens)
    B = m.num_reqs
    if step.defer:
        raise ValueError("spec: a step that verifies drafts cannot be deferred (async scheduling is off "
                         "under speculative decoding)")
    if k.shape != (B,) or (len(k) and k.min() < 0):
        raise ValueError(f"spec.num_draft_tokens must be {B} counts >= 0, got shape {k.shape}")
    D, R = int(k.sum()), B + int(k.sum())
    if len(spec.draft_token_ids) != D:
        raise ValueError(f"spec.draft_token_ids holds {len(spec.draft_token_ids)} tokens, num_draft_tokens {D}")
    li = np.asarray(spec.logits_indices)
    if li.shape != (R,) or (R and (li.min() < 0 or li.max() >= m.num_actual_tokens)):
        raise ValueError(f"spec.logits_indices must be {R} positions in [0, {m.num_actual_tokens})")
    for name in ("temperatures", "seeds", "sample_index"):
        if len(getattr(step, name)) != R:
            raise ValueError(f"{name}: {len(getattr(step, name))} entries, but a speculative step samples "
                             f"{R} logits rows")
