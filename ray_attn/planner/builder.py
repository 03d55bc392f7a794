"""The Planner: turns the engine's scheduled requests into a StepPlan, in one vectorised pass.

``Planner`` is the engine's one entry point; its work splits along two roles.  Which blocks each
request holds -- validation, admission with prefix-cache hits, allocation, prefix-cache indexing,
release -- is ``KVCacheManager``'s (kv_cache.py), a component the Planner calls.  What the step
computes is here: ``Planner._assemble`` is the outline every step follows, over the steps in
step.py, and it ends by committing the step's tokens as computed.  The lengths involved are drawn
in plan.py.

Per-request state lives in persistent numpy arrays indexed by slot (``RequestTable``), so a decode
step costs a few dozen numpy calls plus a few C-level ``map`` passes over the scheduled requests.
Python loops run only over new requests (prefix-cache lookup) and, in a step that admits some, over
the blocks the step fills (``StepPrefixIndex``).  The steady decode step, the last
batch again with one token each, skips the id lookups (``LastBatch``) and the cascade group search
(``CascadeMemo``).

Every call validates all of its input before it changes anything, so a typed error leaves the
planner exactly as it was.
"""

from __future__ import annotations

from operator import attrgetter, getitem
from typing import Hashable, Sequence

import numpy as np

from .cascade import CascadeChoice, CascadeConfig, decide_cascade
from .errors import InvalidRequestError, OutOfBlocksError, PlannerConfigError
from .invariant import check_grid, grid_cascade
from .kv_cache import KVCacheManager
from .plan import ScheduledRequest, StepPlan
from .step_prefix import StepPrefixIndex
from .tiers import KVTiers
from .step import (
    CascadeMemo,
    LastBatch,
    StepBatch,
    cascade_memos,
    cascade_metadata,
    flash_attention_metadata,
    group_order,
    local_attention_metadata,
    make_step_plan,
    pad_to_bucket,
    permuted_list,
    token_positions_and_slots,
    verify_inputs,
    verify_queries,
)

DEFAULT_NUM_SMS = 132  # H100 / H200; workers report the real count (``set_num_sms``)

_get_id = attrgetter("req_id")
_get_toks = attrgetter("token_ids")
_get_new = attrgetter("num_new_tokens")


def _positive(name, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise PlannerConfigError(f"{name} must be a positive int, got {v!r}")
    return int(v)


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
        tiers: KVTiers | None = None,
        cascade_grid: int | None = None,
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
        max_model_len = None if max_model_len is None else _positive("max_model_len", max_model_len)
        self.token_buckets = None
        if token_buckets is not None:
            self.token_buckets = np.array(sorted(_positive("token bucket", b) for b in token_buckets))
        self.use_alibi = bool(use_alibi)
        self._enable_cascade = bool(enable_cascade)
        self._multi_group_cascade = bool(multi_group_cascade)
        # None: vLLM's cost model; an int: the measured policy (``measured_cascade_verdict``).
        self._cascade_min_saved_kv_tokens = cascade_min_saved_kv_tokens
        self._num_sms = _positive("num_sms", num_sms)
        # batch-invariant mode's cascade (invariant.py): a fixed grid of prefix boundaries
        self.cascade_grid = None
        if cascade_grid is not None:
            g = _positive("cascade_grid", cascade_grid)
            if g % self.block_size:
                raise PlannerConfigError(f"cascade_grid {g} is not a multiple of block_size {self.block_size}")
            self.cascade_grid = g
        self._update_cascade_config()  # sets cascade_config and _cascade_cache
        bs = self.block_size
        self._shift = bs.bit_length() - 1 if bs & (bs - 1) == 0 else None
        self.kv = KVCacheManager(_positive("num_blocks", num_blocks), self.block_size, enable_prefix_caching,
                                 _positive("max_num_reqs_hint", max_num_reqs_hint), max_model_len, tiers)
        # the manager's objects, never rebound: the step path reads the table; ``pool`` is public
        self.pool, self.table, self._freed = self.kv.pool, self.kv.table, self.kv.freed
        self._ones = np.ones(0, dtype=np.int32)  # a decode step's query lengths
        self._prev: LastBatch | None = None  # for the fast path of the same batch next step

    def _update_cascade_config(self) -> None:
        """The config the cascade decision reads, from the knobs; forgets the verdicts kept for
        the running batch (one per order the engine may schedule it in; () when none)."""
        self._cascade_cache: tuple[CascadeMemo, ...] = ()
        self.cascade_config = CascadeConfig(
            self.block_size, self.num_query_heads, self.num_kv_heads, self.use_alibi,
            self.sliding_window, self.attention_chunk_size, self.num_sms, self.enable_cascade,
            self.multi_group_cascade, self._cascade_min_saved_kv_tokens,
        )

    # ------------------------------------------------------------------------------------ queries
    @property
    def max_model_len(self) -> int | None:
        return self.kv.max_model_len

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

    def step_prefix_index(self, req_ids, token_ids, num_new_tokens) -> StepPrefixIndex:
        """For a scheduler proposing a step: the full blocks the running requests ``req_ids`` compute
        with ``num_new_tokens`` more tokens each, which the requests it admits after them take as
        prefix-cache hits (``StepPrefixIndex.match``, then ``add_new`` for each admission)."""
        return self.kv.step_prefix_index(req_ids, token_ids, np.asarray(num_new_tokens, dtype=np.int64))

    def num_cached_tokens(self, token_ids, num_new_tokens: int | None = None, root: int | None = None) -> int:
        """Read-only: the tokens a new request with ``token_ids`` would take from the prefix cache."""
        return self.kv.num_cached_tokens(token_ids, num_new_tokens, *(() if root is None else (root,)))

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
        } | ({} if self.kv.tiers is None else self.kv.tiers.stats_dict())

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
        return self.kv.prepare(scheduled, check_capacity=False).num_new_blocks

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

    def rollback(self, req_id: Hashable, num_computed_tokens: int) -> None:
        """Speculative decoding: the step verified drafts and kept the first ones; the request's KV
        now counts only ``num_computed_tokens`` tokens.  The rejected positions' KV stays in its
        blocks until the next tokens overwrite it, and the blocks stay with the request for them.
        None of it is in the prefix cache: draft blocks are never indexed (``index_filled_blocks``),
        and lazy indexing stops at ``num_computed``."""
        slot = self._slot(req_id)
        T, n = self.table, int(num_computed_tokens)
        if not T.num_hashed[slot] * self.block_size <= n <= T.num_computed[slot]:
            raise InvalidRequestError(
                f"request {req_id!r}: rollback to {n} tokens, outside [{T.num_hashed[slot] * self.block_size}, "
                f"{T.num_computed[slot]}] (its indexed blocks .. its computed tokens)")
        T.num_computed[slot] = n
        self._cascade_cache = ()  # a kept verdict's lengths are the step's, not these

    def reset_prefix_cache(self) -> int:
        """Drop every evictable cached block; returns how many."""
        if self.kv.tiers is not None:
            self.kv.tiers.reset()
        return self.pool.reset_prefix_cache()

    def plan(self, scheduled: Sequence[ScheduledRequest]) -> StepPlan:
        """Build the step's plan and advance every scheduled request by its new tokens.

        ``scheduled`` holds objects with ``req_id``, ``token_ids`` and ``num_new_tokens`` (a
        ``ScheduledRequest`` or the engine's own request objects).  Scheduling the same ids in the
        same order as the previous plan (its input order or its ``req_ids``) skips the id lookups.

        Raises, with no state change, InvalidRequestError for bad lengths or duplicate ids and
        OutOfBlocksError when the pool cannot hold the step (the engine then preempts).

        With KV tiers (tiers.py) the plan also carries the copies the step makes first
        (``StepPlan.kv_transfers``).
        """
        tiers = self.kv.tiers
        if tiers is None:
            return self._plan(scheduled)
        tiers.begin_plan()
        plan = self._plan(scheduled)
        plan.kv_transfers = tiers.take_transfers()
        return plan

    def _plan(self, scheduled: Sequence[ScheduledRequest]) -> StepPlan:
        ids, slots = self._same_batch(scheduled)
        if ids is None:
            ids = list(map(_get_id, scheduled))
        toks = list(map(_get_toks, scheduled))
        raw_new = list(map(_get_new, scheduled))
        if slots is None:
            slots = self._same_ids(ids)
        if slots is not None and ids:
            if raw_new.count(1) == len(ids):
                return self._plan_decode(scheduled, ids, toks, slots)
            q = verify_queries(scheduled, raw_new)
            if q is not None:
                return self._plan_decode(scheduled, ids, toks, slots, q)
        b = self.kv.prepare(scheduled, gather=True, columns=(ids, toks, raw_new, slots))
        if self.cascade_grid is not None:
            check_grid(self.cascade_grid, b.ids, b.computed, b.num_new)
        self.kv.admit_and_allocate(b)
        plan = self._assemble(scheduled, b.ids, b.slots, b.computed, b.num_new,
                              self.table.num_blocks[b.slots], b.input_ids)
        plan.num_prefix_cache_hit_tokens = b.hit_tokens
        plan.num_new_blocks = b.num_new_blocks
        self.kv.index_filled_blocks(b)
        return plan

    def _same_batch(self, scheduled):
        """(ids, slots) of the previous plan when ``scheduled`` holds the very same objects in its
        input or plan order (one C-level identity compare, for objects that compare by identity;
        req_id must not change on a scheduled object), else (None, None)."""
        prev = self._prev
        if prev is None or not scheduled or type(scheduled[0]).__eq__ is not object.__eq__:
            return None, None
        if scheduled == prev.scheduled:
            return prev.ids, prev.slots
        if scheduled == prev.planned_scheduled:
            return prev.planned_ids, prev.planned_slots
        return None, None

    def _same_ids(self, ids):
        """The previous plan's slots when ``ids`` are its ids in its input or plan order, else None."""
        prev = self._prev
        if prev is not None:
            if ids == prev.ids:
                return prev.slots
            if ids == prev.planned_ids:
                return prev.planned_slots
        return None

    # ------------------------------------------------------------------------------------ decode
    def _plan_decode(self, scheduled, ids, toks, slots, q=None) -> StepPlan:
        """Steady state: the previous batch again, one new token each -- or, with ``q``, each row's
        one token and its drafts (a verifying step: ``verify_queries``).  Such a step admits no
        request and fills no prefill block, so it skips ``prepare``'s general path: its blocks
        are indexed for the prefix cache when the request is freed, as a decode step's are."""
        B, T = len(ids), self.table
        computed = T.num_computed[slots]
        if q is None:
            try:  # token_ids[computed] is both the input and the length check
                input_ids = np.fromiter(map(getitem, toks, computed.tolist()), np.int64, B)
            except IndexError:
                lens = np.fromiter(map(len, toks), np.int64, B)
                i = int(np.flatnonzero(lens <= computed)[0])
                self.kv.bad_len(ids[i], 1, int(computed[i]), int(lens[i]))
            except (TypeError, ValueError, OverflowError) as e:
                raise InvalidRequestError(f"token ids must be ints: {e}") from None
            if len(self._ones) != B:  # the query lengths, kept: the fast path sees the same B again
                self._ones = np.ones(B, dtype=np.int32)
            q = self._ones
        else:
            input_ids = verify_inputs(self.kv, ids, toks, computed, q)
        seq = computed + q
        max_len = self.kv.max_model_len
        if max_len is not None and int(seq.max()) > max_len:
            i = int(seq.argmax())
            self.kv.bad_len(ids[i], int(q[i]), int(computed[i]), int(seq[i]))
        if self.cascade_grid is not None and q is not self._ones:
            check_grid(self.cascade_grid, ids, computed, q)
        nblocks = T.num_blocks[slots]
        num_new_blocks = self.kv.allocate_decode_blocks(slots, seq, nblocks)
        plan = self._assemble(scheduled, ids, slots, computed, q, nblocks, input_ids)
        plan.num_new_blocks = num_new_blocks
        return plan

    # ------------------------------------------------------------------------------------ the plan
    def _assemble(self, scheduled, ids, slots, computed, q, nblocks, input_ids) -> StepPlan:
        """Build the step's plan from a batch whose blocks are allocated, then commit the step.

        The outline of every step, decode or not; each step is a function of step.py or a method
        below, and only the last one, ``_commit_step``, changes the planner's state.  ``batch`` and
        ``choice`` have their rows in the engine's order, ``planned`` and ``planned_choice`` in the
        plan's."""
        batch = StepBatch.gather(self.table, ids, slots, computed, q, nblocks, input_ids)
        choice, memo = self._decide_cascade(batch)
        perm, planned_choice = None, choice
        if memo is not None:  # the same decode batch as last step: the same order
            perm, planned_choice = memo.perm, memo.planned_choice
        elif choice.use:  # each group's requests, and so its query tokens, contiguous
            perm, planned_choice = group_order(choice)
        planned = batch if perm is None else batch.permuted(perm)

        qsl, positions, slot_mapping = token_positions_and_slots(planned, self.table, self.block_size,
                                                                 self._shift)
        input_ids, positions, slot_mapping = pad_to_bucket(self.token_buckets, planned.input_ids, positions,
                                                           slot_mapping)
        attn = flash_attention_metadata(planned, qsl, slot_mapping)
        prefix_part = None
        if choice.use:
            prefix_part = cascade_metadata(attn, planned, planned_choice, self.block_size,
                                           memo.prefix_part if memo is not None else None)
        if self.attention_chunk_size is not None:
            attn.local_attn_metadata = local_attention_metadata(self.attention_chunk_size, qsl, planned,
                                                                self.block_size)
        plan = make_step_plan(planned, attn, input_ids, positions, planned_choice)
        lora = self.table.lora_slot[planned.slots]  # each row's adapter: per-row metadata like the rest
        plan.lora_slots = lora if len(lora) and lora.max() >= 0 else None

        memos = cascade_memos(batch, choice, perm, planned, planned_choice, prefix_part, memo)
        self._commit_step(scheduled, batch, perm, planned, memos)
        return plan

    def _decide_cascade(self, batch: StepBatch) -> tuple[CascadeChoice, CascadeMemo | None]:
        """Whether and how the step cascades (rows in the engine's order), and the memo of the last
        step whose verdict it reuses (None: decided afresh, or refused by a length rule)."""
        if self.cascade_grid is not None:  # batch-invariant mode: the grid, never a kept verdict
            return grid_cascade(self.cascade_grid, self.block_size, batch.block_table, batch.computed), None
        memo = None
        if batch.decode:  # a decode step of the last plan's slots object, in either of its orders
            for kept in self._cascade_cache:
                if kept.slots is batch.slots:
                    memo = kept
        choice = decide_cascade(self.cascade_config, batch.block_table, batch.computed, batch.q,
                                batch.max_seq, maybe_shared=self.pool.num_shared_blocks > 0,
                                reuse=memo.choice if memo is not None else None)
        return choice, (memo if memo is not None and choice is memo.choice else None)

    def _commit_step(self, scheduled, batch: StepBatch, perm, planned: StepBatch,
                     memos: tuple[CascadeMemo, ...]) -> None:
        """Commit the step, the only state the assembly changes: its tokens count as computed (their
        KV is written when the step runs, so the next plan starts each request at ``seq``), and the
        batch, in both orders, and its cascade memos are kept for the next step's fast path."""
        self.table.num_computed[planned.slots] = planned.seq
        objs = list(scheduled)
        planned_objs = objs if perm is None else permuted_list(objs, perm)
        self._prev = LastBatch(objs, batch.ids, batch.slots, planned_objs, planned.ids, planned.slots)
        self._cascade_cache = memos
