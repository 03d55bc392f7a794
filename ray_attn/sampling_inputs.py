"""The driver's side of sampling beyond temperature and seed: what a step sends the ranks for it
(``SamplingInputs``), and the logprobs it reads back (``TokenLogprobs``).

Only rows that sample this step and use a feature are sent for it; a batch of plain requests
(``SamplingParams.plain``) sends nothing, so it costs one attribute read per row.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ray_attn.request import PLACEHOLDER, Request, TokenLogprobs
from ray_attn.runtime.messages import LogprobsArrays, PromptLogprobsInputs, SamplingInputs
from ray_attn.structured_output import GrammarSync


def build_sampling_inputs(reqs: Sequence[Request], samples: Sequence[bool], sample_index: np.ndarray,
                          eos_token_ids: frozenset[int], vocab_size: int,
                          grammars: GrammarSync | None = None,
                          history_ends: Sequence[int] | None = None,
                          draft_ranges: Sequence[tuple[int, int]] | None = None) -> SamplingInputs | None:
    """The step's ``SamplingInputs`` (None when no sampling row needs any), built before the
    step's placeholders are appended: a row's history then ends in at most one placeholder, the
    previous step's token (async scheduling), which rank 0 fills from that step's ``sampled_row``.
    ``sample_index[i]`` is the index of the token row i draws (tokens generated so far).
    ``grammars``: what rank 0 holds of the constrained rows' grammars (needed when any row has one).
    ``history_ends[i]``: how many of row i's tokens (``Request.token_array()``) its penalties
    see; default all.  Speculative decoding repeats a request once per draft position, each
    seeing its history up to there (spec/decoder.py).  ``draft_ranges[i]`` = (first draft's
    token index, its index among the step's drafts), when the drafts are a draft model's: made on
    the ranks, they enter the histories there (``history_draft_index``)."""
    if all(r.params.plain for r in reqs):
        return None
    rows = [i for i, (r, s) in enumerate(zip(reqs, samples)) if s and not r.params.plain]
    if not rows:
        return None
    B, si = len(reqs), SamplingInputs()
    filtered = [i for i in rows if reqs[i].params.filters]
    if filtered:
        si.top_k, si.top_p, si.min_p = np.zeros(B, np.int32), np.ones(B, np.float32), np.zeros(B, np.float32)
        for i in filtered:
            p = reqs[i].params
            si.top_k[i], si.top_p[i], si.min_p[i] = p.top_k, p.top_p, p.min_p
    penalized = [i for i in rows if reqs[i].params.penalized]
    if penalized:
        _penalty_inputs(si, [reqs[i] for i in penalized], vocab_size,
                        None if history_ends is None else [history_ends[i] for i in penalized],
                        None if draft_ranges is None else [draft_ranges[i] for i in penalized])
        si.penalty_rows = np.array(penalized, np.int32)
    mask_rows, mask_ids = [], []
    for i in rows:
        p = reqs[i].params
        if p.min_tokens and sample_index[i] < p.min_tokens:
            ids = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | eos_token_ids
            mask_rows += [i] * len(ids)
            mask_ids += sorted(ids)
    if mask_rows:
        si.min_tokens_rows, si.min_tokens_ids = np.array(mask_rows, np.int32), np.array(mask_ids, np.int32)
    biased = [i for i in rows if reqs[i].params.logit_bias]
    if biased:
        pairs = [(i, t, b) for i in biased for t, b in reqs[i].params.logit_bias]
        si.logit_bias_rows = np.array([i for i, _, _ in pairs], np.int32)
        si.logit_bias_ids = np.array([t for _, t, _ in pairs], np.int32)
        si.logit_bias_values = np.array([b for _, _, b in pairs], np.float32)
    constrained = [i for i in rows if reqs[i].grammar is not None]
    if constrained:
        if grammars is None:
            raise ValueError("a constrained row needs the engine's GrammarSync")
        grammars.fill(si, constrained, [reqs[i] for i in constrained],
                      None if history_ends is None else [history_ends[i] - reqs[i].num_prompt_tokens
                                                         for i in constrained])
    wants = [i for i in rows if reqs[i].params.logprobs is not None]
    if wants:
        si.logprobs = np.full(B, -1, np.int32)
        si.logprobs[wants] = [reqs[i].params.logprobs for i in wants]
    return si


def _penalty_inputs(si: SamplingInputs, reqs: list[Request], vocab_size: int, ends=None, drafts=None) -> None:
    """Each penalized row's token history (see ``SamplingInputs``): its prompt, offset by the
    vocabulary size, only when it has a repetition penalty; then its output; then the previous
    step's token, as a placeholder, when that is still out.  ``drafts[j]``: (first draft's token
    index, its index among the step's drafts) of a row whose drafts rank 0 fills in."""
    parts, lens, prev_index, prev_rows, offset = [], [], [], [], 0
    draft_index, draft_src = [], []
    presence, frequency, repetition = [], [], []
    for j, r in enumerate(reqs):
        p = r.params
        if r.pending > 1:
            raise RuntimeError(f"request {r.request_id} has {r.pending} tokens out; a step's history "
                               "can wait for one only")
        toks = r.token_array() if ends is None else r.token_array()[:ends[j]]
        n0 = r.num_prompt_tokens
        n = len(toks) - n0
        if p.repetition_penalty != 1:
            parts.append(toks[:n0] + np.int32(vocab_size))
            n += n0
        parts.append(toks[n0:])
        if drafts is not None and len(toks) > drafts[j][0]:  # its last tokens: drafts made on the ranks
            first, src = drafts[j]
            t = np.arange(len(toks) - first)
            draft_index += (offset + n - len(t) + t).tolist()
            draft_src += (src + t).tolist()
        if r.pending:
            prev_index.append(offset + n)
            prev_rows.append(r.sampled_row)
            parts.append(np.array([PLACEHOLDER], np.int32))
            n += 1
        lens.append(n)
        offset += n
        presence.append(p.presence_penalty)
        frequency.append(p.frequency_penalty)
        repetition.append(p.repetition_penalty)
    si.history = np.concatenate(parts).astype(np.int32, copy=False)
    si.history_lens = np.array(lens, np.int32)
    si.presence_penalty = np.array(presence, np.float32)
    si.frequency_penalty = np.array(frequency, np.float32)
    si.repetition_penalty = np.array(repetition, np.float32)
    if prev_index:
        si.history_prev_index, si.history_prev_rows = np.array(prev_index, np.int32), np.array(prev_rows, np.int32)
    if draft_index:
        si.history_draft_index, si.history_draft_src = np.array(draft_index, np.int32), np.array(draft_src, np.int32)


def token_logprobs(lp: LogprobsArrays, j: int, k: int) -> TokenLogprobs:
    """Row ``j`` of a step's logprobs, with its own ``k`` top entries (the step pads to its
    largest k)."""
    ids, lps = lp.logprob_token_ids[j], lp.logprobs[j]
    return TokenLogprobs(int(ids[0]), float(lps[0]), int(lp.selected_token_ranks[j]),
                         list(zip(ids[1:1 + k].tolist(), lps[1:1 + k].tolist())))


def prompt_logprobs_inputs(plan, reqs: Sequence[Request]) -> tuple[PromptLogprobsInputs | None, list]:
    """The prompt positions this step computes logits for (``PromptLogprobsInputs``, None when no
    row asked) and the (request, first position, count) spans they answer, in order.

    A row computing tokens [c, c + q) has the logits that predict tokens c + 1 .. c + q; those
    still in its prompt, and not already submitted by an earlier step, are its targets.  A
    request that asks takes no prefix-cache hits, so its first chunk starts at 0 and the targets
    run on without a gap; a recompute after preemption skips those already submitted."""
    if all(r.prompt_logprobs is None for r in reqs):
        return None, []
    qsl, computed = plan.attn.query_start_loc, plan.num_computed_tokens
    indices, targets, spans, k = [], [], [], 0
    for row, r in enumerate(reqs):
        if r.prompt_logprobs is None:
            continue
        c, q = int(computed[row]), int(qsl[row + 1] - qsl[row])
        lo, hi = max(c + 1, r.prompt_logprobs_submitted), min(c + q, r.num_prompt_tokens - 1)
        if lo > hi:
            continue
        if lo > r.prompt_logprobs_submitted:
            raise RuntimeError(f"request {r.request_id}: prompt logprobs from position "
                               f"{r.prompt_logprobs_submitted} were never computed (its step starts "
                               f"at {c}: a prefix-cache hit it should not have taken)")
        start = int(qsl[row]) + lo - 1 - c
        indices.append(np.arange(start, start + hi - lo + 1, dtype=np.int32))
        targets.append(np.asarray(r.token_ids[lo:hi + 1], np.int32))
        spans.append((r, lo, hi - lo + 1))
        r.prompt_logprobs_submitted = hi + 1
        k = max(k, r.params.prompt_logprobs)
    if not spans:
        return None, []
    return PromptLogprobsInputs(np.concatenate(indices), np.concatenate(targets), k), spans


def apply_prompt_logprobs(spans: list, lp: LogprobsArrays | None) -> None:
    """Append each span's prompt logprobs to its request, where it is still the next span the
    request expects (a request that finished, or whose ranks died meanwhile, is skipped)."""
    if lp is None:
        raise RuntimeError("a step that computed prompt logprobs answered without them")
    off = 0
    for r, lo, n in spans:
        if not r.finished and r.prompt_logprobs is not None and len(r.prompt_logprobs) == lo:
            k = r.params.prompt_logprobs
            r.prompt_logprobs.extend(token_logprobs(lp, j, k) for j in range(off, off + n))
        off += n
