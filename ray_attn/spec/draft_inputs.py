"""The driver's side of a draft model (``method='draft_model'``): what the ranks run to propose.

The draft runs on the target's ranks with a KV cache of its own that has the target's block
geometry, so it reads and writes through the target's block tables: a position's slot is the
same in both caches, and the planner allocates for both at once.

Each request records how many of its leading tokens the draft cache holds
(``Request.num_draft_computed``).  Two kinds of rows give the draft work in a step
(``build_draft_inputs``):
- a row carrying a prompt chunk (or a preempted request's recomputed tokens): the draft computes
  the same chunk in the same step, so it never meets a whole prompt inside a decode step;
- a row that speculates: the draft first runs a *catch-up* query over the tokens past what its
  cache holds, ending at the row's last sampled token, whose argmax is draft 1; then one
  single-token pass per further draft.  The catch-up takes at least the row's last two tokens
  (``CATCH_UP_TOKENS``), so that in the steady state every row's catch-up has that length and
  replays a graph.

A row that decodes without drafts for a while (a batch above ``disable_by_batch_size``) costs
the draft nothing until it speculates again, and then one longer catch-up.  After a verifying
step the draft cache holds the row's committed tokens and drafts 1..k-1; of these, the accepted
ones stay valid (``committed_after``).  A preempted request (its blocks given away) or one whose
ranks died starts again from 0 (``Request.num_draft_computed`` is reset where
``num_preemptions`` grows, and by ``drop_pending``).

A prefix-cache hit is trusted for the draft too: a new request's draft starts where the target
does, since the draft computed the shared blocks alongside the request that filled them.  Blocks
filled by tokens decoded without drafts, or brought back from the host tier (which moves the
target's cache only), hold no draft KV for their tokens; drafts read from them are worse, which
costs acceptance, never correctness (verification is exact).

Everything here is numpy, built from the step's plan; ``runtime/draft_runner.py`` runs it.
"""

from __future__ import annotations

import numpy as np

from ray_attn.metadata import FlashAttentionMetadata
from ray_attn.runtime.messages import CATCH_UP_TOKENS, DraftInputs, DraftPass


def _slots(block_table: np.ndarray, positions: np.ndarray, block_size: int, dtype) -> np.ndarray:
    """The cache slot of each (row, position): ``block_table`` [N, W] holds each entry's row."""
    blocks = np.take_along_axis(block_table, (positions // block_size)[:, None], axis=1)[:, 0]
    return (blocks.astype(np.int64) * block_size + positions % block_size).astype(dtype)


def _decode_metadata(block_table: np.ndarray, positions: np.ndarray, block_size: int,
                     slot_dtype) -> FlashAttentionMetadata:
    """One token per row at ``positions`` (written there, attending to everything before)."""
    n = len(positions)
    seq_lens = (positions + 1).astype(np.int32)
    return FlashAttentionMetadata(
        num_actual_tokens=n, max_query_len=1, query_start_loc=np.arange(n + 1, dtype=np.int32),
        max_seq_len=int(seq_lens.max()), seq_lens=seq_lens, block_table=block_table,
        slot_mapping=_slots(block_table, positions, block_size, slot_dtype))


def build_draft_inputs(plan, reqs, num_drafts: np.ndarray | None, block_size: int) -> DraftInputs | None:
    """The draft's work for a step whose rows ``reqs`` (the plan's order) verify ``num_drafts``
    [B] drafts each (0 or None: the row does not speculate), or None when it has none.

    Two kinds of rows: those that speculate, and those whose query carries a prompt's chunk
    (or a preempted request's recomputed tokens), which the draft computes alongside the target
    so that it never meets a whole prompt in one decode step: such a catch-up would stall that
    step for a full prefill of the draft, with activations the memory profile did not count.
    Rows that decode without drafts are left for their next speculating step."""
    B = len(reqs)
    k_all = np.zeros(B, np.int32) if num_drafts is None else np.asarray(num_drafts, np.int32)
    m = plan.attn
    query = np.diff(np.asarray(m.query_start_loc, np.int64))[:B]
    computed = np.asarray(plan.num_computed_tokens, np.int64)[:B]
    rows, ends, starts = [], [], []
    for r in range(B):
        req = reqs[r]
        if k_all[r]:
            # n: tokens before the drafts, the last of them the row's last sampled token (the
            # verifying query's first).  The catch-up takes at least the last two: in the steady
            # state every row's catch-up is then exactly 2 tokens (rewriting one the draft holds,
            # with the same values), which the draft's graphs of 2-token queries replay -- 1 token
            # after a partly accepted run and 2 after a fully accepted one would be ragged.
            n = len(req.token_ids) - req.num_drafts
            have = max(0, min(req.num_draft_computed, n - CATCH_UP_TOKENS))
        elif query[r] > 1:  # a chunk of known tokens: the draft computes it too
            n = int(computed[r] + query[r])
            # A new request starts where the target does: the blocks of a prefix-cache hit hold
            # the draft KV that the draft computed alongside the request that filled them.
            have = min(req.num_draft_computed or int(computed[r]), n)
            req.num_draft_computed = n  # this step writes them (lost ranks reset it: drop_pending)
        else:
            continue
        if n > have:
            rows.append(r)
            starts.append(have)
            ends.append(n)
    if not rows:
        return None
    rows = np.asarray(rows, np.int64)
    k = k_all[rows]
    n, have = np.asarray(ends, np.int64), np.asarray(starts, np.int64)
    slot_dtype = np.asarray(m.slot_mapping).dtype
    q = n - have
    qsl = np.zeros(len(rows) + 1, np.int32)
    np.cumsum(q, out=qsl[1:])
    width = int(-(-(n + np.maximum(k, 1) - 1).max() // block_size))  # the blocks up to the last token written
    table = np.ascontiguousarray(np.asarray(m.block_table)[rows, :width])
    tokens = np.concatenate([np.asarray(reqs[r].token_ids[have[i]:n[i]], np.int32)
                             for i, r in enumerate(rows.tolist())])
    positions = (np.arange(int(q.sum())) - np.repeat(qsl[:-1], q) + np.repeat(have, q)).astype(np.int64)
    owner = np.repeat(np.arange(len(rows)), q)
    catchup = FlashAttentionMetadata(
        num_actual_tokens=int(q.sum()), max_query_len=int(q.max()), query_start_loc=qsl,
        max_seq_len=int(n.max()), seq_lens=n.astype(np.int32), block_table=table,
        slot_mapping=_slots(table[owner], positions, block_size, slot_dtype))
    passes = []
    for j in range(1, int(k.max())):  # pass j reads draft j (at position n - 1 + j) for draft j + 1
        live = np.flatnonzero(k > j).astype(np.int32)
        pos = n[live] - 1 + j
        passes.append(DraftPass(rows=live, positions=pos.astype(np.int32),
                                metadata=_decode_metadata(table[live], pos, block_size, slot_dtype)))
    ends_q = np.asarray(m.query_start_loc[1:], np.int64)[rows]
    target_index = (np.repeat(ends_q - k, k) + np.arange(int(k.sum())) - np.repeat(np.cumsum(k) - k, k))
    return DraftInputs(metadata=catchup, input_token_ids=tokens, positions=positions.astype(np.int32),
                       num_draft_tokens=k.astype(np.int32), passes=passes, target_index=target_index.astype(np.int32),
                       rows=rows.astype(np.int32))


def committed_after(computed: int, k: int, accepted: int) -> int:
    """How many of a row's tokens the draft cache holds after a step that verified ``k`` drafts
    with ``computed`` tokens before them in the target's cache, ``accepted`` of them kept: the
    catch-up wrote up to the row's last sampled token (``computed + 1`` tokens), the passes
    drafts 1..k-1 after it, and of those the accepted ones are the row's tokens now."""
    return computed + 1 + min(accepted, k - 1)
