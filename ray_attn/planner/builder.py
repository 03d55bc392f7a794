"""The Planner: turns the engine's scheduled requests into a StepPlan, in one vectorised pass.

Per-request state lives in persistent numpy arrays indexed by slot (``RequestTable``), so a decode
step costs a few dozen numpy calls plus a few C-level ``map`` passes over the scheduled requests.
Python loops run only over new requests (prefix-cache lookup).

Prefix-cache indexing: blocks filled by prefill steps are hashed in the step (so that requests
arriving next step, e.g. more samples of the same prompt, share them); blocks filled by decode steps
are hashed lazily, when the request is freed (finished or preempted), so that the steady decode
step does no hashing.  A new request therefore shares another request's *generated* blocks only
once that request has been freed (multi-turn chat, preemption by recompute).

Every call validates all of its input before it changes anything, so a typed error leaves the
planner exactly as it was.
"""

from __future__ import annotations

from operator import attrgetter, getitem, itemgetter
from typing import Hashable, NamedTuple, Sequence

import numpy as np

from ray_attn.metadata import FlashAttentionMetadata, LocalAttentionMetadata

from .cascade import CascadeChoice, CascadeConfig, decide_cascade, fill_cascade_metadata
from .errors import InvalidRequestError, OutOfBlocksError, PlannerConfigError
from .kv_cache import KVCacheManager
from .local import make_local_attention_virtual_batches
from .plan import ScheduledRequest, StepPlan

DEFAULT_NUM_SMS = 132  # H100 / H200; workers report the real count (``set_num_sms``)

_get_id = attrgetter("req_id")
_get_toks = attrgetter("token_ids")
_get_new = attrgetter("num_new_tokens")


def _permuted(items: list, perm: np.ndarray) -> list:
    return list(itemgetter(*perm.tolist())(items)) if len(perm) > 1 else list(items)


def _positive(name, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise PlannerConfigError(f"{name} must be a positive int, got {v!r}")
    return int(v)


class _BatchOrder(NamedTuple):
    """One order of a planned batch: the engine's objects, their ids and their table slots."""

    scheduled: list
    ids: list
    slots: np.ndarray


class _LastBatch(NamedTuple):
    """The last plan's batch, kept so that the same batch next step (steady decode) skips the id
    lookups: the engine may schedule it in its own order or in the plan's (cascade groups
    contiguous); both are the same when the plan did not reorder."""

    as_scheduled: _BatchOrder
    as_planned: _BatchOrder


class _CascadeMemo(NamedTuple):
    """A decode batch's reusable cascade verdict, for the next decode step of the same batch (same
    ``slots`` object: it comes from ``_LastBatch``)."""

    slots: np.ndarray
    choice: CascadeChoice
    perm: np.ndarray | None  # rows of ``slots`` -> the plan's order; None: already in order
    prefix_part: tuple | None  # fill_cascade_metadata's step-independent part, when cascading


class Planner:
    """Driver-side planner of one model replica (numpy only).

    Engine protocol: ``plan(scheduled)`` every step (it admits unknown ids as new requests, takes
    their prefix-cache hits and allocates blocks, all or nothing); ``can_schedule`` / ``allocate``
    to check or reserve ahead; ``free(req_id)`` when a request finishes or is preempted.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_query_heads: int,
        num_kv_heads: int,
        use_alibi: bool = False,
        sliding_window: int | None = None,
        attention_chunk_size: int | None = None,
        num_sms: int = DEFAULT_NUM_SMS,
        enable_prefix_caching: bool = True,
        enable_cascade: bool = True,
        multi_group_cascade: bool = True,
        cascade_min_saved_kv_tokens: int | None = None,
        max_model_len: int | None = None,
        token_buckets: Sequence[int] | None = None,
        max_num_reqs_hint: int = 256,
    ):
        self.block_size = _positive("block_size", block_size)
        self.num_query_heads = _positive("num_query_heads", num_query_heads)
        self.num_kv_heads = _positive("num_kv_heads", num_kv_heads)
        if self.num_query_heads % self.num_kv_heads:
            raise PlannerConfigError(
                f"num_query_heads {num_query_heads} is not a multiple of num_kv_heads {num_kv_heads}"
            )
        self.sliding_window = None if sliding_window is None else _positive("sliding_window", sliding_window)
        self.attention_chunk_size = None
        if attention_chunk_size is not None:
            c = _positive("attention_chunk_size", attention_chunk_size)
            if c % self.block_size:
                raise PlannerConfigError(
                    f"attention_chunk_size {c} is not a multiple of block_size {self.block_size}"
                )
            self.attention_chunk_size = c
        self.max_model_len = None if max_model_len is None else _positive("max_model_len", max_model_len)
        self.token_buckets = None
        if token_buckets is not None:
            self.token_buckets = np.array(sorted(_positive("token bucket", b) for b in token_buckets))
        self.use_alibi = bool(use_alibi)
        # The running batch's reusable cascade verdicts: one per order the engine may schedule it
        # in (see _CascadeMemo); () when none.
        self._cascade_cache: tuple[_CascadeMemo, ...] = ()
        self._enable_cascade = bool(enable_cascade)
        self._multi_group_cascade = bool(multi_group_cascade)
        # None: vLLM's cost model; an int: the measured policy (``measured_cascade_verdict``).
        self._cascade_min_saved_kv_tokens = cascade_min_saved_kv_tokens
        self._num_sms = _positive("num_sms", num_sms)
        self._update_cascade_config()
        bs = self.block_size
        self._shift = bs.bit_length() - 1 if bs & (bs - 1) == 0 else None
        self.kv = KVCacheManager(_positive("num_blocks", num_blocks), self.block_size, enable_prefix_caching,
                                 _positive("max_num_reqs_hint", max_num_reqs_hint), self.max_model_len)
        # the manager's, shared (never rebound): the step path reads the table, tests the rest
        self.pool, self.table, self._freed = self.kv.pool, self.kv.table, self.kv.freed
        self._ones = np.ones(0, dtype=np.int32)
        self._prev: _LastBatch | None = None

    def _split(self, positions):
        """(block index, offset in block) of token positions."""
        if self._shift is not None:
            return positions >> self._shift, positions & (self.block_size - 1)
        return np.divmod(positions, self.block_size)

    def _update_cascade_config(self) -> None:
        self._cascade_cache = ()
        self.cascade_config = CascadeConfig(
            self.block_size, self.num_query_heads, self.num_kv_heads, self.use_alibi,
            self.sliding_window, self.attention_chunk_size, self.num_sms, self.enable_cascade,
            self.multi_group_cascade, self._cascade_min_saved_kv_tokens,
        )

    # ------------------------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_requests(self) -> int:
        return len(self.table.slot_of)

    @property
    def enable_prefix_caching(self) -> bool:
        return self.pool.enable_prefix_caching

    # The cascade knobs may change between steps (e.g. a benchmark toggling cascade): each setter
    # refreshes the config the decision reads and drops the verdict kept for the running batch.
    @property
    def num_sms(self) -> int:
        return self._num_sms

    @num_sms.setter
    def num_sms(self, value: int) -> None:
        self._num_sms = _positive("num_sms", value)
        self._update_cascade_config()

    def set_num_sms(self, num_sms: int) -> None:
        """The SM count of the workers' GPUs (the cascade cost model's wave size)."""
        self.num_sms = num_sms

    @property
    def enable_cascade(self) -> bool:
        return self._enable_cascade

    @enable_cascade.setter
    def enable_cascade(self, value: bool) -> None:
        self._enable_cascade = bool(value)
        self._update_cascade_config()

    @property
    def multi_group_cascade(self) -> bool:
        return self._multi_group_cascade

    @multi_group_cascade.setter
    def multi_group_cascade(self, value: bool) -> None:
        self._multi_group_cascade = bool(value)
        self._update_cascade_config()

    @property
    def cascade_min_saved_kv_tokens(self) -> int | None:
        return self._cascade_min_saved_kv_tokens

    @cascade_min_saved_kv_tokens.setter
    def cascade_min_saved_kv_tokens(self, value: int | None) -> None:
        self._cascade_min_saved_kv_tokens = value
        self._update_cascade_config()

    def has_request(self, req_id: Hashable) -> bool:
        return req_id in self.table.slot_of

    def _slot(self, req_id: Hashable) -> int:
        return self.kv.slot(req_id)

    def num_computed_tokens(self, req_id: Hashable) -> int:
        return int(self.table.num_computed[self._slot(req_id)])

    def block_ids(self, req_id: Hashable) -> np.ndarray:
        slot = self._slot(req_id)
        return self.table.block_table[slot, : self.table.num_blocks[slot]].copy()

    def num_cached_tokens(self, token_ids, num_new_tokens: int | None = None) -> int:
        """Read-only: the tokens a new request with ``token_ids`` would take from the prefix cache."""
        return self.kv.num_cached_tokens(token_ids, num_new_tokens)

    @property
    def prefix_cache_queries(self) -> int:
        return self.kv.prefix_cache_queries  # prompt tokens of new requests looked up

    @property
    def prefix_cache_hits(self) -> int:
        return self.kv.prefix_cache_hits  # of which found in the cache

    def stats(self) -> dict:
        return {
            "num_requests": self.num_requests,
            "num_free_blocks": self.pool.num_free_blocks,
            "num_used_blocks": self.pool.num_used_blocks,
            "num_cached_blocks": self.pool.num_cached_blocks,
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "num_evictions": self.pool.num_evictions,
        }

    # ------------------------------------------------------------------------------------ engine API
    def can_schedule(self, scheduled: Sequence[ScheduledRequest]) -> bool:
        """Whether ``plan(scheduled)`` would find the blocks it needs (no state change).  Other bad
        input still raises."""
        try:
            self.kv.prepare(scheduled)
        except OutOfBlocksError:
            return False
        return True

    def blocks_needed(self, scheduled: Sequence[ScheduledRequest]) -> int:
        """Blocks ``plan(scheduled)`` would allocate (no state change)."""
        return int(self.kv.prepare(scheduled, check_capacity=False).need.sum())

    def allocate(self, req_id: Hashable, token_ids, num_new_tokens: int | None = None) -> int:
        """Reserve blocks for ``num_new_tokens`` more tokens of one request (admitting it with its
        prefix-cache hit when new).  Returns its computed tokens (for a new one, the cache hit).
        A later ``plan`` that schedules these tokens allocates nothing more for them."""
        b = self.kv.prepare([ScheduledRequest(req_id, token_ids, num_new_tokens)])
        self.kv.admit_and_allocate(b)
        return int(self.table.num_computed[b.slots[0]])

    def free(self, req_id: Hashable) -> None:
        """Release a finished or preempted request's blocks; full ones stay in the prefix cache."""
        self.kv.free(req_id)  # raises UnknownRequestError / DoubleFreeError
        self._prev = None  # the remembered batch held this slot
        self._cascade_cache = ()

    def reset_prefix_cache(self) -> int:
        """Drop every evictable cached block; returns how many."""
        return self.pool.reset_prefix_cache()

    def plan(self, scheduled: Sequence[ScheduledRequest]) -> StepPlan:
        """Build the step's plan and advance every scheduled request by its new tokens.

        ``scheduled`` holds objects with ``req_id``, ``token_ids`` and ``num_new_tokens`` (a
        ``ScheduledRequest`` or the engine's own request objects).  Scheduling the same ids in the
        same order as the previous plan (its input order or its ``req_ids``) skips the id lookups.

        Raises, with no state change, InvalidRequestError for bad lengths or duplicate ids and
        OutOfBlocksError when the pool cannot hold the step (the engine then preempts).
        """
        ids, slots = self._same_batch(scheduled)
        if ids is None:
            ids = list(map(_get_id, scheduled))
        toks = list(map(_get_toks, scheduled))
        raw_new = list(map(_get_new, scheduled))
        if slots is None:
            slots = self._same_ids(ids)
        if slots is not None and ids and raw_new.count(1) == len(ids):
            return self._plan_decode(scheduled, ids, toks, slots)
        b = self.kv.prepare(scheduled, gather=True, columns=(ids, toks, raw_new, slots))
        num_new_blocks = int(b.need.sum())
        self.kv.admit_and_allocate(b)
        plan = self._assemble(scheduled, b.ids, b.slots, b.computed, b.num_new,
                              self.table.num_blocks[b.slots], b.input_ids)
        plan.num_prefix_cache_hit_tokens = b.hit_tokens
        plan.num_new_blocks = num_new_blocks
        self.kv.index_filled_blocks(b)
        return plan

    def _same_batch(self, scheduled):
        """(ids, slots) of the previous plan when ``scheduled`` holds the very same objects in its
        input or plan order (one C-level identity compare, for objects that compare by identity;
        req_id must not change on a scheduled object), else (None, None)."""
        prev = self._prev
        if prev is None or not scheduled or type(scheduled[0]).__eq__ is not object.__eq__:
            return None, None
        for order in prev:
            if scheduled == order.scheduled:
                return order.ids, order.slots
        return None, None

    def _same_ids(self, ids):
        """The previous plan's slots when ``ids`` are its ids in its input or plan order, else None."""
        if self._prev is not None:
            for order in self._prev:
                if ids == order.ids:
                    return order.slots
        return None

    # ------------------------------------------------------------------------------------ decode
    def _plan_decode(self, scheduled, ids, toks, slots) -> StepPlan:
        """Steady state: the previous batch again, one new token each."""
        B, T = len(ids), self.table
        computed = T.num_computed[slots]
        try:  # token_ids[computed] is both the input and the length check
            input_ids = np.fromiter(map(getitem, toks, computed.tolist()), np.int64, B)
        except IndexError:
            lens = np.fromiter(map(len, toks), np.int64, B)
            i = int(np.flatnonzero(lens <= computed)[0])
            self.kv.bad_len(ids[i], 1, int(computed[i]), int(lens[i]))
        except (TypeError, ValueError, OverflowError) as e:
            raise InvalidRequestError(f"token ids must be ints: {e}") from None
        if self.max_model_len is not None and int(computed.max()) >= self.max_model_len:
            i = int(computed.argmax())
            self.kv.bad_len(ids[i], 1, int(computed[i]), int(computed[i]) + 1)
        nblocks = T.num_blocks[slots]
        num_new_blocks = self.kv.allocate_decode_blocks(slots, computed, nblocks)
        if len(self._ones) < B:
            self._ones = np.ones(2 * B, dtype=np.int32)
        plan = self._assemble(scheduled, ids, slots, computed, self._ones[:B], nblocks, input_ids)
        plan.num_new_blocks = num_new_blocks
        return plan

    # ------------------------------------------------------------------------------------ the plan
    def _assemble(self, scheduled, ids, slots, computed, q, nblocks, input_ids) -> StepPlan:
        """Build the plan from the batch (blocks already allocated), then commit the step."""
        bs, T = self.block_size, self.table
        B = len(ids)
        decode = len(input_ids) == B
        seq = computed + q
        in_ids, in_slots = ids, slots
        width = max(int(nblocks.max()) if B else 0, 1)
        bt = T.block_table[slots, :width]
        max_seq = int(seq.max()) if B else 0
        reuse = reuse_perm = reuse_part = None
        if decode:
            for memo in self._cascade_cache:
                if memo.slots is slots:
                    reuse, reuse_perm, reuse_part = memo.choice, memo.perm, memo.prefix_part
        choice = decide_cascade(self.cascade_config, bt, computed, q, max_seq,
                                maybe_shared=self.pool.num_shared_blocks > 0, reuse=reuse)
        labels, ref_rows, perm = choice.labels, choice.ref_rows, None
        if choice.use and len(choice.prefix_blocks) > 1:
            if choice is reuse:
                perm = reuse_perm
            else:  # each group's requests (and so its tokens) contiguous
                perm = np.argsort(labels, kind="stable")
                if (perm[1:] > perm[:-1]).all():
                    perm = None
        if perm is not None:
            if not decode:
                starts = np.cumsum(q) - q  # token i of new row r comes from old row perm[r]
                qp = q[perm]
                src = np.repeat(starts[perm] - (np.cumsum(qp) - qp), qp) + np.arange(len(input_ids))
                input_ids = input_ids[src]
            else:
                input_ids = input_ids[perm]
            bt, computed, q, seq, nblocks, labels, slots = (
                bt[perm], computed[perm], q[perm], seq[perm], nblocks[perm], labels[perm], slots[perm]
            )
            ids = _permuted(ids, perm)
            ref_rows = np.argsort(perm)[ref_rows]

        N = len(input_ids)
        if decode:
            qsl = np.arange(B + 1, dtype=np.int32)
            positions = computed
            blk, off = self._split(computed)
            flat = slots * T.width + blk
        else:
            qsl = np.zeros(B + 1, dtype=np.int32)
            qsl[1:] = np.cumsum(q)
            positions = (np.arange(N) - np.repeat(qsl[:-1] - computed, q)).astype(np.int32)
            blk, off = self._split(positions)
            flat = np.repeat(slots * T.width, q) + blk
        slot_mapping = T.flat.take(flat) * bs + off

        num_tokens = N
        if self.token_buckets is not None:
            k = int(np.searchsorted(self.token_buckets, N))
            if k < len(self.token_buckets):
                num_tokens = int(self.token_buckets[k])
        if num_tokens == N:
            slot_out = slot_mapping.astype(np.int32, copy=False)
            pos_out = positions.astype(np.int32)  # a copy: num_computed_tokens keeps `computed`
            ids_out = input_ids.astype(np.int32)
        else:  # padding: slot -1 (not written), token 0, position 0
            slot_out = np.full(num_tokens, -1, dtype=np.int32)
            slot_out[:N] = slot_mapping
            pos_out = np.zeros(num_tokens, dtype=np.int32)
            pos_out[:N] = positions
            ids_out = np.zeros(num_tokens, dtype=np.int32)
            ids_out[:N] = input_ids

        seq = seq.astype(np.int32, copy=False)
        attn = FlashAttentionMetadata(
            num_actual_tokens=N,
            max_query_len=(1 if decode else int(q.max())) if B else 0,
            query_start_loc=qsl,
            max_seq_len=max_seq,
            seq_lens=seq,
            block_table=bt,
            slot_mapping=slot_out,
        )
        if choice.use:
            part = fill_cascade_metadata(attn, bt, nblocks, seq, q, labels, choice.prefix_blocks,
                                         ref_rows, bs, reuse_part if choice is reuse else None)
        # Keep the verdict for the next decode step of this batch, in the input order (with its
        # permutation) and in the plan's order (already grouped).
        self._cascade_cache = ()
        if choice.reusable and decode:
            part = part if choice.use else None
            self._cascade_cache = (_CascadeMemo(in_slots, choice, perm, part),)
            if perm is not None:
                grouped = CascadeChoice(True, choice.reason, labels, choice.prefix_blocks, ref_rows, True)
                self._cascade_cache += (_CascadeMemo(slots, grouped, None, part),)
        C = self.attention_chunk_size
        if C is not None and max_seq > C:  # else every key is in chunk 0: local == causal
            sq, cuq, sk, tab = make_local_attention_virtual_batches(C, qsl, seq, bt, bs)
            attn.local_attn_metadata = LocalAttentionMetadata(
                local_query_start_loc=cuq,
                local_seqused_k=sk,
                local_block_table=tab,
                local_max_query_len=int(sq.max()),
                local_max_seq_len=int(sk.max()),
            )
        plan = StepPlan(
            req_ids=ids,
            attn=attn,
            input_token_ids=ids_out,
            positions=pos_out,
            logits_indices=qsl[1:] - 1,
            num_computed_tokens=computed.astype(np.int32, copy=False),
            cascade_reason=choice.reason,
            num_cascade_groups=len(choice.prefix_blocks) if choice.use else 0,
            cascade_group_ids=labels.astype(np.int32) if choice.use else None,
        )

        # commit: the step's tokens count as computed (their KV is written when the step runs)
        T.num_computed[slots] = seq
        objs = list(scheduled)
        self._prev = _LastBatch(_BatchOrder(objs, in_ids, in_slots),
                                _BatchOrder(objs if perm is None else _permuted(objs, perm), ids, slots))
        return plan
