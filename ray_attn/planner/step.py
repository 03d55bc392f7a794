"""One step's batch as named per-request arrays, and the steps that turn it into the plan's arrays.

``Planner._assemble`` (builder.py) is the outline every step follows; its steps are here, as
functions of their inputs, so that each reads on its own, with the named types of what the planner
keeps from one step to the next (``LastBatch``, ``CascadeMemo``).  They are vectorised numpy over
the batch: the planner runs on the driver every step, and a Python loop per request or per token
would show at a thousand requests.  The lengths they juggle (``computed``, ``q``, ``seq``, ``qsl``,
block table columns, slots) are drawn in plan.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from operator import getitem, itemgetter

import numpy as np

from ray_attn.metadata import FlashAttentionMetadata, LocalAttentionMetadata

from .cascade import CascadeChoice, fill_cascade_metadata
from .errors import InvalidRequestError
from .kv_cache import _get_drafts
from .local import make_local_attention_virtual_batches
from .plan import StepPlan
from .slots import RequestTable


def permuted_list(items: list, perm: np.ndarray) -> list:
    """``[items[i] for i in perm]`` in one C-level call."""
    return list(itemgetter(*perm.tolist())(items)) if len(perm) > 1 else list(items)


@dataclass(slots=True)
class StepBatch:
    """The requests of one step, blocks already allocated.  Row r of every array is request
    ``ids[r]``; a permutation moves all of them together (``permuted``)."""

    ids: list  # req_ids
    slots: np.ndarray  # [B] their RequestTable rows
    computed: np.ndarray  # [B] int32 num_computed_tokens: tokens in the cache before this step
    q: np.ndarray  # [B] int32 query lengths: tokens computed this step
    seq: np.ndarray  # [B] int32 seq_lens: computed + q, the KV length once the step ran
    num_blocks: np.ndarray  # [B] blocks each request holds, this step's included
    block_table: np.ndarray  # [B, width] their block table rows (a copy); width >= 1
    input_ids: np.ndarray  # [N] the step's tokens, request after request (N = q.sum())
    num_reqs: int  # B
    decode: bool  # one token per request: N == B, token r is request r's
    max_seq: int  # seq.max(), 0 for an empty batch

    @classmethod
    def gather(cls, table: RequestTable, ids, slots, computed, q, num_blocks, input_ids) -> StepBatch:
        """The batch of ``slots``, with its block table rows read out of ``table``."""
        B = len(ids)
        width = max(int(num_blocks.max()) if B else 0, 1)
        seq = computed + q  # int32: both are
        return cls(ids, slots, computed, q, seq, num_blocks, table.block_table[slots, :width], input_ids,
                   B, len(input_ids) == B, int(seq.max()) if B else 0)

    def permuted(self, perm: np.ndarray) -> StepBatch:
        """The batch with row r taken from row ``perm[r]``; each request's tokens move with it."""
        if self.decode:
            input_ids = self.input_ids[perm]
        else:  # token i of new row r comes from old row perm[r], at the same offset in its span
            q = self.q
            starts = np.cumsum(q) - q
            qp = q[perm]
            src = np.repeat(starts[perm] - (np.cumsum(qp) - qp), qp) + np.arange(len(self.input_ids))
            input_ids = self.input_ids[src]
        return StepBatch(permuted_list(self.ids, perm), self.slots[perm], self.computed[perm], self.q[perm],
                         self.seq[perm], self.num_blocks[perm], self.block_table[perm], input_ids,
                         self.num_reqs, self.decode, self.max_seq)


# --------------------------------------------------------------------------------- cascade order
def group_order(choice: CascadeChoice) -> tuple[np.ndarray | None, CascadeChoice]:
    """The row order that makes each cascade group's requests, and so its query tokens, contiguous
    (the prefix pass reads each group's queries as one range), and ``choice`` in that order (its
    labels and reference rows moved).  ``(None, choice)`` when the rows already are in order."""
    if not choice.use or len(choice.prefix_blocks) <= 1:
        return None, choice
    perm = np.argsort(choice.labels, kind="stable")
    if (perm[1:] > perm[:-1]).all():
        return None, choice
    return perm, CascadeChoice(choice.use, choice.reason, choice.labels[perm], choice.prefix_blocks,
                               np.argsort(perm)[choice.ref_rows], choice.reusable)


# --------------------------------------------------------------------------------- tokens
def token_positions_and_slots(batch: StepBatch, table: RequestTable, block_size: int,
                              shift: int | None):
    """``query_start_loc`` [B + 1], and per token its position in its request [N] and the cache
    slot its KV goes to [N]: block ``block_table[row, position // block_size]``, at the offset
    ``position % block_size``.  ``shift`` is log2(block_size) when that is a power of two (a shift
    and a mask instead of a division)."""
    B = batch.num_reqs
    if batch.decode:  # one token per request, at position `computed`
        qsl = np.arange(B + 1, dtype=np.int32)
        positions = batch.computed
        rows = batch.slots * table.width
    else:
        qsl = np.zeros(B + 1, dtype=np.int32)
        qsl[1:] = np.cumsum(batch.q)
        positions = (np.arange(len(batch.input_ids)) - np.repeat(qsl[:-1] - batch.computed, batch.q)
                     ).astype(np.int32)
        rows = np.repeat(batch.slots * table.width, batch.q)
    if shift is not None:
        blk, off = positions >> shift, positions & (block_size - 1)
    else:
        blk, off = np.divmod(positions, block_size)
    return qsl, positions, table.flat.take(rows + blk) * block_size + off


def pad_to_bucket(token_buckets: np.ndarray | None, input_ids, positions, slot_mapping):
    """The model inputs as int32 (ids, positions, slots), padded to the smallest token bucket that
    holds them (CUDA graphs are captured per bucket).  Padding: token 0, position 0, slot -1 (the
    cache write skips it)."""
    N = num_tokens = len(input_ids)
    if token_buckets is not None:
        k = int(np.searchsorted(token_buckets, N))
        if k < len(token_buckets):
            num_tokens = int(token_buckets[k])
    if num_tokens == N:
        # positions: a copy, since on the decode path they are the batch's `computed`, which the
        # plan hands out as num_computed_tokens
        return (input_ids.astype(np.int32), positions.astype(np.int32),
                slot_mapping.astype(np.int32, copy=False))
    slot_out = np.full(num_tokens, -1, dtype=np.int32)
    slot_out[:N] = slot_mapping
    pos_out = np.zeros(num_tokens, dtype=np.int32)
    pos_out[:N] = positions
    ids_out = np.zeros(num_tokens, dtype=np.int32)
    ids_out[:N] = input_ids
    return ids_out, pos_out, slot_out


# --------------------------------------------------------------------------------- metadata
def flash_attention_metadata(batch: StepBatch, qsl: np.ndarray,
                             slot_mapping: np.ndarray) -> FlashAttentionMetadata:
    """The plain (non-cascade, non-local) attention metadata of the batch."""
    return FlashAttentionMetadata(
        num_actual_tokens=len(batch.input_ids),
        max_query_len=(1 if batch.decode else int(batch.q.max())) if batch.num_reqs else 0,
        query_start_loc=qsl,
        max_seq_len=batch.max_seq,
        seq_lens=batch.seq,
        block_table=batch.block_table,
        slot_mapping=slot_mapping,
    )


def cascade_metadata(attn: FlashAttentionMetadata, planned: StepBatch, choice: CascadeChoice,
                     block_size: int, prefix_part=None):
    """Write the cascade fields of ``attn`` for a step that cascades (``planned`` and ``choice`` in
    the plan's order, groups contiguous).  Returns their step-independent part, for the memo
    (``prefix_part``: the memo's, to skip recomputing it)."""
    return fill_cascade_metadata(attn, planned.block_table, planned.num_blocks, planned.seq, planned.q,
                                 choice.labels, choice.prefix_blocks, choice.ref_rows, block_size,
                                 prefix_part)


def local_attention_metadata(chunk: int, qsl: np.ndarray, batch: StepBatch,
                             block_size: int) -> LocalAttentionMetadata | None:
    """Chunked local attention's virtual batches of chunk size ``chunk``; None when every key is in
    chunk 0 (local attention is then plain causal attention)."""
    if batch.max_seq <= chunk:
        return None
    sq, cuq, sk, tab = make_local_attention_virtual_batches(chunk, qsl, batch.seq, batch.block_table,
                                                            block_size)
    return LocalAttentionMetadata(
        local_query_start_loc=cuq,
        local_seqused_k=sk,
        local_block_table=tab,
        local_max_query_len=int(sq.max()),
        local_max_seq_len=int(sk.max()),
    )


def make_step_plan(batch: StepBatch, attn: FlashAttentionMetadata, input_ids: np.ndarray,
                   positions: np.ndarray, choice: CascadeChoice) -> StepPlan:
    """The plan of ``batch`` (in plan order, ``choice`` too) from its metadata and padded inputs."""
    return StepPlan(
        req_ids=batch.ids,
        attn=attn,
        input_token_ids=input_ids,
        positions=positions,
        logits_indices=attn.query_start_loc[1:] - 1,
        num_computed_tokens=batch.computed,  # int32 (the table's), and never the table's own array
        cascade_reason=choice.reason,
        num_cascade_groups=len(choice.prefix_blocks) if choice.use else 0,
        cascade_group_ids=choice.labels.astype(np.int32) if choice.use else None,
    )


# --------------------------------------------------------------------------------- for the next step
@dataclass(slots=True)
class LastBatch:
    """The last plan's batch, kept so that the same batch next step (steady decode) skips the id
    lookups: the engine's objects, their ids and their table slots, in the order the engine
    scheduled them and in the plan's (cascade groups contiguous), which the engine may schedule
    next instead.  The two orders are the same lists when the plan did not reorder."""

    scheduled: list
    ids: list
    slots: np.ndarray
    planned_scheduled: list
    planned_ids: list
    planned_slots: np.ndarray


@dataclass(slots=True)
class CascadeMemo:
    """A decode batch's reusable cascade verdict, kept for the next decode step of the same batch:
    the group search is the expensive part of the decision, and its result holds while no request
    joins or leaves (the length rules are checked again every step)."""

    slots: np.ndarray  # the batch's slots: matched by identity, the fast path hands them back
    choice: CascadeChoice  # rows in the order of ``slots``
    perm: np.ndarray | None  # rows of ``slots`` -> the plan's order; None: already in order
    planned_choice: CascadeChoice  # ``choice`` in the plan's order (``group_order``)
    prefix_part: tuple | None  # fill_cascade_metadata's step-independent part, when cascading


def cascade_memos(batch: StepBatch, choice: CascadeChoice, perm, planned: StepBatch,
                  planned_choice: CascadeChoice, prefix_part,
                  memo: CascadeMemo | None) -> tuple[CascadeMemo, ...]:
    """What to keep of this step's verdict: when it is reusable and the step decodes, one memo per
    order the engine may schedule the batch in next, its own (with the permutation) and the plan's
    (already grouped); else none.  ``memo``, the one this step reused, holds the same again."""
    if not (choice.reusable and batch.decode):
        return ()
    kept = memo if memo is not None else CascadeMemo(batch.slots, choice, perm, planned_choice, prefix_part)
    if perm is None:
        return (kept,)
    return (kept, CascadeMemo(planned.slots, planned_choice, None, planned_choice, prefix_part))


# --------------------------------------------------------------------------------- verifying steps
def verify_queries(scheduled, raw_new) -> np.ndarray | None:
    """int32 query lengths of a step whose every row is one token and its drafts (speculative
    decoding's verifying step: ``num_new_tokens == 1 + num_draft_tokens``, at least one draft),
    else None: a prefill chunk, a new row or an automatic length takes the general path."""
    if None in raw_new:
        return None
    drafts = np.fromiter(map(_get_drafts, scheduled), np.int32, len(scheduled))
    try:
        q = np.fromiter(raw_new, np.int32, len(raw_new))
    except (TypeError, ValueError, OverflowError):
        return None  # the general path names what is wrong
    if not drafts.any() or (q != drafts + 1).any() or (drafts < 0).any():
        return None
    return q


def verify_inputs(kv, ids, toks, computed, q) -> np.ndarray:
    """A verifying step's input tokens, each row's ``token_ids[computed:computed + q]``; a row
    whose tokens end before that is refused by name (``kv.bad_len``)."""
    B = len(ids)
    seq = computed + q
    try:
        lens = np.fromiter(map(len, toks), np.int64, B)
    except TypeError as e:
        raise InvalidRequestError(f"token_ids must be sequences of ints: {e}") from None
    short = np.flatnonzero(lens < seq)
    if len(short):
        i = int(short[0])
        kv.bad_len(ids[i], int(q[i]), int(computed[i]), int(lens[i]))
    spans = map(getitem, toks, map(slice, computed.tolist(), seq.tolist()))
    try:
        return np.fromiter(chain.from_iterable(spans), np.int64, int(q.sum()))
    except (TypeError, ValueError, OverflowError) as e:
        raise InvalidRequestError(f"token ids must be ints: {e}") from None
