"""Which KV-cache blocks each request holds: admission, allocation, prefix-cache indexing, release.

The planner has two roles: this one, the request lifecycle against the block pool (vLLM's
``KVCacheManager``), and building the step's arrays (builder.py, step.py).  ``KVCacheManager`` owns
everything the first needs -- the ``BlockPool``, the per-request ``RequestTable``, the ids freed
lately, the length limit, the prefix-cache counters -- and the ``Planner`` calls it (composition):

* ``prepare`` validates one call and works out what it needs (prefix hits, blocks), changing
  nothing, so that a typed error leaves the planner as it was;
* ``admit_and_allocate`` then admits the new requests with their hits and allocates; the decode
  fast path's ``allocate_decode_blocks`` does the same for one token per request;
* ``index_filled_blocks`` hashes the blocks a prefill step fills; ``free`` hashes the ones decode
  steps filled (lazily) and releases the request's blocks.

The step path reads the table (block table rows, ``num_computed``) and commits ``num_computed``
itself: that is the step's own bookkeeping, not block ownership.

Prefix-cache indexing: blocks filled by prefill steps are hashed in the step (so that requests
arriving next step share them), and the requests admitted *in* a step share the full blocks an
earlier one of that step computes (``StepPrefixIndex``, step_prefix.py: the ``n`` samples of one
prompt compute it once).  Blocks filled by decode steps are hashed lazily, by the next step that
admits a request or when the request is freed (finished or preempted), so that the steady decode
step does no hashing.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import chain
from operator import attrgetter, getitem
from typing import Hashable

import numpy as np

from .block_pool import ROOT_HASH, BlockPool, chain_hashes, content_hashes
from .errors import DoubleFreeError, InvalidRequestError, OutOfBlocksError, UnknownRequestError
from .slots import RequestTable
from .step_prefix import StepPrefixIndex
from .tiers import KVTiers

_get_id = attrgetter("req_id")
_get_toks = attrgetter("token_ids")
_get_new = attrgetter("num_new_tokens")


def _get_drafts(s) -> int:
    return getattr(s, "num_draft_tokens", 0)  # any object with req_id/token_ids/num_new_tokens plans


_REMEMBER_FREED = 1 << 16  # freed ids kept to tell a double free from an unknown id


class PreparedBatch:
    """One call's validated input and what it needs, before any state changes (general path).
    Rows are in scheduled order; new requests are the rows ``new_rows`` (slot -1 until admitted)."""

    __slots__ = (
        "ids",  # req_ids
        "toks",  # each request's token_ids (the engine's sequences, not copied)
        "slots",  # RequestTable rows
        "computed",  # [B] num_computed_tokens before this step (a new request: its prefix hit)
        "num_new",  # [B] int32 tokens scheduled this step (the query lengths)
        "need",  # [B] blocks to allocate
        "num_new_blocks",  # need.sum()
        "new_rows",  # rows of requests not admitted yet
        "hits",  # per new row, the prefix-cache blocks it takes (-1: one an earlier row computes)
        "step_hits",  # (row, column, computing row, its column) for each -1 in ``hits``
        "hit_hashes",  # per new row, the chain hash of its last hit block
        "hit_tokens",  # tokens the new rows take from the prefix cache
        "input_ids",  # [num tokens] this step's tokens, request after request (with ``gather``)
        "index",  # the StepPrefixIndex of the new rows' hits (None: none built), its hashes reused
        "tier_hits",  # per new row, (column, tier, source, chain hash) of each lower-tier hit (tiers.py)
        "num_tier_blocks",  # fresh blocks those hits are copied into
        "drafts",  # [B] int64 draft tokens at the end of each row's new tokens (speculative decoding)
        "new_lora",  # per new row, its adapter slot (ScheduledRequest.lora_slot)
    )


class KVCacheManager:
    """The blocks of every running request (see the module docstring).  What changes state runs
    on input ``prepare`` (or, for decode, the planner's fast path) already validated."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 max_num_reqs_hint: int, max_model_len: int | None, tiers: KVTiers | None = None):
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self.tiers = tiers if enable_prefix_caching else None
        if self.tiers is not None:
            self.pool.on_evict, self.pool.on_index = self.tiers.evicted, self.tiers.indexed
        self.table = RequestTable(max_num_reqs_hint)
        self.freed: OrderedDict[Hashable, None] = OrderedDict()
        self.prefix_cache_queries = 0  # prompt tokens of new requests looked up
        self.prefix_cache_hits = 0  # of which found in the cache

    def slot(self, req_id: Hashable) -> int:
        """The table row of a running request; a typed error for a freed or unknown id."""
        slot = self.table.slot_of.get(req_id)
        if slot is None:
            if req_id in self.freed:
                raise DoubleFreeError(f"request {req_id!r} was already freed")
            raise UnknownRequestError(f"unknown request id {req_id!r}")
        return slot

    def step_prefix_index(self, req_ids, toks, num_new) -> StepPrefixIndex:
        """The scheduler's look-ahead: a ``StepPrefixIndex`` holding what the running requests
        ``req_ids`` fill with ``num_new`` more tokens each, for the requests it admits after them."""
        index = StepPrefixIndex(self)
        if req_ids:
            slots = np.fromiter(map(self.slot, req_ids), np.intp, len(req_ids))
            index.add_running(np.arange(len(slots)), slots, toks, self.table.num_computed[slots] + num_new)
        return index

    def num_cached_tokens(self, token_ids, num_new_tokens: int | None = None, root: int = ROOT_HASH) -> int:
        """Read-only: the tokens a new request with ``token_ids`` (under the adapter whose chains
        start at ``root``) would take from the prefix cache."""
        max_blocks = self.max_hit_blocks(len(token_ids), num_new_tokens)
        return len(self.pool.lookup(token_ids, max_blocks, root)[0]) * self.block_size

    def max_hit_blocks(self, num_tokens: int, num_new_tokens: int | None) -> int:
        # vLLM recomputes at least the last token (its logits are needed); an explicit
        # num_new_tokens also caps the hit so that the scheduled tokens stay inside token_ids.
        cap = num_tokens - 1 if num_new_tokens is None else min(num_tokens - 1, num_tokens - num_new_tokens)
        return max(cap, 0) // self.block_size

    def prepare(self, scheduled, check_capacity=True, gather=False, columns=None) -> PreparedBatch:
        """Validate one call's input and work out what it needs; changes nothing.  With ``gather``
        it also collects the step's input token ids (in scheduled order)."""
        if columns is None:
            columns = (list(map(_get_id, scheduled)), list(map(_get_toks, scheduled)),
                       list(map(_get_new, scheduled)), None)
        ids, toks, raw_new, slots = columns
        B = len(ids)
        b = PreparedBatch()
        b.ids, b.toks = ids, toks
        if slots is None:
            slots, b.new_rows = self.table.lookup(ids)
        else:
            slots, b.new_rows = slots.copy(), []
        b.slots = slots
        computed = self.table.num_computed[slots]  # new rows read slot -1: overwritten below
        nblocks = self.table.num_blocks[slots]
        b.hits, b.hit_hashes, b.hit_tokens, b.step_hits, b.index = [], [], 0, [], None
        b.tier_hits, b.num_tier_blocks, b.new_lora = [], 0, []
        try:
            lens = np.fromiter(map(len, toks), np.int64, B)
        except TypeError as e:
            raise InvalidRequestError(f"token_ids must be sequences of ints: {e}") from None
        auto = None in raw_new
        try:
            num_new = np.array([0 if x is None else x for x in raw_new] if auto else raw_new, dtype=np.int64)
        except (TypeError, ValueError, OverflowError) as e:
            raise InvalidRequestError(f"num_new_tokens must be ints or None: {e}") from None
        if num_new.shape != (B,):
            raise InvalidRequestError(f"num_new_tokens must be ints or None, got {raw_new[:8]!r}")
        b.drafts = np.fromiter(map(_get_drafts, scheduled), np.int64, B) if B else np.zeros(0, np.int64)
        index = None
        if b.new_rows and self.pool.enable_prefix_caching:
            index = b.index = StepPrefixIndex(self)
            run = np.flatnonzero(slots >= 0)
            if len(run):
                auto_run = [raw_new[i] is None for i in run.tolist()]
                n_run = np.where(auto_run, lens[run] - computed[run], num_new[run]) - b.drafts[run]
                # capped at the tokens a row has: a bad length is refused below, never read past
                index.add_running(run, slots[run], [toks[i] for i in run.tolist()],
                                  np.minimum(computed[run] + n_run, lens[run]))
        for i in b.new_rows:
            nn = None if raw_new[i] is None else int(num_new[i])
            if nn is not None and not 1 <= nn <= lens[i]:
                self.bad_len(ids[i], nn, 0, int(lens[i]))
            root = getattr(scheduled[i], "cache_root", ROOT_HASH)
            b.new_lora.append(getattr(scheduled[i], "lora_slot", -1))
            if index is None:
                hit, last_hash = [], root
            else:
                m = index.match(toks[i], nn, read=not getattr(scheduled[i], "skip_prefix_cache", False), root=root)
                index.add_new(i, m, int(lens[i]) - m.num_tokens if nn is None else nn)
                hit, last_hash = m.blocks, m.last_hash
                b.step_hits += [(i, *src) for src in m.step_hits]
                if m.tier_hits:
                    b.tier_hits.append([(c, kind, src, int(m.hashes[c])) for c, kind, src in m.tier_hits])
                    b.num_tier_blocks += len(m.tier_hits)
                else:
                    b.tier_hits.append(())
            b.hits.append(hit)
            b.hit_hashes.append(last_hash)
            computed[i] = len(hit) * self.block_size
            nblocks[i] = len(hit)
            b.hit_tokens += len(hit) * self.block_size
        if auto:
            num_new = np.where(np.array([x is None for x in raw_new]), lens - computed, num_new)
        seq = computed + num_new
        bad = (num_new < 1) | (seq > lens) | (b.drafts < 0) | (b.drafts >= num_new)
        if self.max_model_len is not None:
            bad |= seq > self.max_model_len
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            self.bad_len(ids[i], int(num_new[i]), int(computed[i]), int(lens[i]))
        b.computed = computed
        b.num_new = num_new.astype(np.int32)
        b.need = np.maximum(-(-seq // self.block_size) - nblocks, 0)
        b.num_new_blocks = int(b.need.sum())
        b.input_ids = None
        if gather:
            spans = map(getitem, toks, map(slice, computed.tolist(), seq.tolist()))
            try:
                b.input_ids = np.fromiter(chain.from_iterable(spans), np.int64, int(num_new.sum()))
            except (TypeError, ValueError, OverflowError) as e:
                raise InvalidRequestError(f"token ids must be ints: {e}") from None
        if check_capacity:
            total = b.num_new_blocks + b.num_tier_blocks
            available = self.pool.num_free_blocks
            if b.new_rows and total:
                # hits on evictable blocks take them out of the allocatable set
                claimed = {x for hit in b.hits for x in hit if x >= 0 and self.pool.is_evictable(x)}
                available -= len(claimed)
            if total > available:
                raise OutOfBlocksError(total, available, f"{B} requests scheduled")
        return b

    def bad_len(self, req_id, num_new, computed, num_tokens):
        """Raise the InvalidRequestError of a request whose scheduled tokens do not fit."""
        limit = f", max_model_len {self.max_model_len}" if self.max_model_len is not None else ""
        raise InvalidRequestError(
            f"request {req_id!r}: num_new_tokens {num_new} with {computed} computed does not fit "
            f"its {num_tokens} tokens (need 1 <= num_new_tokens <= {num_tokens - computed}{limit})"
        )

    # ------------------------------------------------------------------------------------ state
    def admit_and_allocate(self, b: PreparedBatch) -> None:
        """Admit new requests (taking their prefix hits) and allocate the missing blocks."""
        T = self.table
        if b.new_rows:
            new = np.array(b.new_rows)
            b.slots[new] = slots = list(map(T.add, [b.ids[i] for i in b.new_rows]))
            for i in b.new_rows:
                self.freed.pop(b.ids[i], None)
                T.tokens[b.slots[i]] = b.toks[i]
            n_hit = np.fromiter(map(len, b.hits), np.int64, len(new))
            T.num_blocks[slots] = T.num_hashed[slots] = n_hit
            T.num_computed[slots] = n_hit * self.block_size
            T.last_hash[slots] = np.array(b.hit_hashes, dtype=np.uint64)
            T.lora_slot[slots] = b.new_lora
            if n_hit.any():
                # before allocating: no hit evicted.  An in-step hit (-1) is taken after it.
                self.pool.acquire([x for x in chain.from_iterable(b.hits) if x >= 0])
                T.ensure_width(int(n_hit.max()))
                for slot, hit in zip(slots, b.hits):
                    if hit:
                        T.block_table[slot, : len(hit)] = hit
            if b.num_tier_blocks:
                self._claim_tier_hits(b, slots)
            self.prefix_cache_queries += int(np.fromiter(map(len, [b.toks[i] for i in b.new_rows]),
                                                         np.int64, len(new)).sum())
            self.prefix_cache_hits += int(n_hit.sum()) * self.block_size
        if b.num_new_blocks:
            rows = b.need.nonzero()[0]
            slots = b.slots[rows]
            self._append_blocks(slots, T.num_blocks[slots], b.need[rows], self.pool.allocate(b.num_new_blocks))
        if b.step_hits:  # the blocks an earlier row of this step computes, allocated by now
            row, col, src, src_col = np.array(b.step_hits, dtype=np.int64).T
            shared = T.block_table[b.slots[src], src_col]
            T.block_table[b.slots[row], col] = shared
            self.pool.acquire(shared.tolist())

    def _claim_tier_hits(self, b: PreparedBatch, slots) -> None:
        """Fresh blocks for the new rows' lower-tier hits, which the step copies in before its
        forward (``KVTiers.claim``); indexed at once, so that later steps hit them as usual."""
        flat = [(slot, *t) for slot, hits in zip(slots, b.tier_hits) for t in hits]
        self.tiers.pin([(kind, src) for _, _, kind, src, _ in flat])  # before evictions pick host slots
        fresh = self.pool.allocate(b.num_tier_blocks)  # what it evicts may go to the host tier
        slot_col = np.array([(slot, col) for slot, col, _, _, _ in flat], np.int64)
        self.table.block_table[slot_col[:, 0], slot_col[:, 1]] = fresh
        hashes = [h for *_, h in flat]
        self.tiers.claim([(kind, src) for _, _, kind, src, _ in flat], fresh.tolist(), hashes)
        self.pool.cache_blocks(fresh.tolist(), hashes)

    def allocate_decode_blocks(self, slots: np.ndarray, seq: np.ndarray, nblocks: np.ndarray) -> int:
        """The decode fast path's allocation: the blocks each request needs to hold ``seq``
        tokens -- one for a decode row whose last block is full, up to 1 + k / block_size more
        for a row verifying k drafts (``nblocks`` is updated in place).  Returns how many; the
        caller checked the lengths."""
        need = -(-seq // self.block_size) - nblocks
        grow = (need > 0).nonzero()[0]
        if len(grow):
            need = need[grow]
            total = int(need.sum())
            if total > self.pool.num_free_blocks:
                raise OutOfBlocksError(total, self.pool.num_free_blocks, f"{len(slots)} decode requests")
            start = nblocks[grow]
            self._append_blocks(slots[grow], start, need, self.pool.allocate(total))
            nblocks[grow] = start + need
            return total
        return 0

    def _append_blocks(self, slots: np.ndarray, start: np.ndarray, need: np.ndarray, blocks: np.ndarray) -> None:
        """Rows ``slots``, holding ``start`` blocks each, take ``need`` more each from ``blocks``
        (in order: row r's at columns start[r] .. start[r] + need[r] - 1)."""
        T = self.table
        T.ensure_width(int((start + need).max()))
        cols = np.repeat(start - (np.cumsum(need) - need), need) + np.arange(len(blocks))
        T.flat[np.repeat(slots, need) * T.width + cols] = blocks
        T.num_blocks[slots] = start + need

    def index_filled_blocks(self, b: PreparedBatch) -> None:
        """Index the blocks this (general-path) step fills, so that requests arriving next step
        share them; decode steps leave theirs to ``free``."""
        if self.pool.enable_prefix_caching:
            # not the drafts' blocks: a draft the step rejects leaves KV that other tokens overwrite
            full = (b.computed + b.num_new - b.drafts) // self.block_size
            rows = (full > self.table.num_hashed[b.slots]).nonzero()[0]
            if len(rows):
                self._hash_rows(rows, b.slots, b.toks, full,
                                known=None if b.index is None else b.index.filled_blocks())

    def free(self, req_id: Hashable) -> None:
        """Release a request's blocks, indexing first the full ones decode steps filled (lazy), so
        that they outlive the request in the prefix cache."""
        slot = self.slot(req_id)  # raises UnknownRequestError / DoubleFreeError
        T = self.table
        if self.pool.enable_prefix_caching and T.tokens[slot] is not None:
            full = min(int(T.num_computed[slot]), len(T.tokens[slot])) // self.block_size
            if full > T.num_hashed[slot]:
                self._hash_rows(np.zeros(1, np.intp), np.array([slot]), [T.tokens[slot]], np.array([full]),
                                dedupe=False)
        _, blocks = T.remove(req_id)
        self.pool.release(blocks)
        self.freed[req_id] = None
        if len(self.freed) > _REMEMBER_FREED:
            self.freed.popitem(last=False)

    def fill_hashes(self, slots, toks, full):
        """Chain hashes of the full blocks table rows ``slots`` (their tokens ``toks``) have not
        indexed yet, columns ``num_hashed .. full - 1`` (vectorised: one token gather, one content
        hash, one chain hash for all of them).  Returns each hash's row (an index into ``slots``),
        its column, the hashes, and each row's new indexed end.

        A negative id is a token not sampled yet (the engine's async scheduling plans the next step
        before this one's tokens exist).  Hashing it would index -- and dedupe onto -- a block whose
        content is unknown, so each row stops at its first such block; freeing the request hashes
        the rest once the tokens are real."""
        T, bs = self.table, self.block_size
        start = T.num_hashed[slots].astype(np.int64)
        end = np.maximum(np.asarray(full, dtype=np.int64), start)
        nb = end - start
        n = int(nb.sum())
        spans = map(getitem, toks, map(slice, (start * bs).tolist(), (end * bs).tolist()))
        tok = np.fromiter(chain.from_iterable(spans), np.int64, n * bs).reshape(n, bs)
        row = np.repeat(np.arange(len(nb)), nb)
        local = np.arange(n) - np.repeat(np.cumsum(nb) - nb, nb)
        h = chain_hashes(content_hashes(tok), nb, T.last_hash[slots])
        if n and tok.min() < 0:
            first = np.array(nb, copy=True)
            bad = np.flatnonzero((tok < 0).any(axis=1))
            np.minimum.at(first, row[bad], local[bad])
            keep = local < first[row]
            row, local, h = row[keep], local[keep], h[keep]
            end = start + first
        return row, local + start[row], h, end

    def _hash_rows(self, rows, slots, toks, full, dedupe: bool = True, known=None) -> None:
        """Index the full blocks of batch ``rows`` (ascending) up to ``full[row]`` blocks: hashed by
        ``fill_hashes``, or ``known`` already (batch row, column, hash of each, by row).

        With ``dedupe``, a block whose content another block already holds is swapped for that
        block and freed.  Same KV, one copy: memory comes back and the requests now share the
        block ids that cascade groups are detected from.  The current step still writes the old
        block (its plan is built), and later steps read the shared one.  Requests of one step
        share what an earlier one computes (``StepPrefixIndex``), so this is left mostly to the
        blocks a hit may not take: a prompt's last block, recomputed for its logits, or those past
        a hit capped by an explicit ``num_new_tokens``."""
        T = self.table
        s = slots[rows]
        rt = [toks[i] for i in rows.tolist()]
        for slot, t in zip(s.tolist(), rt):  # keep the latest reference for lazy hashing
            T.tokens[slot] = t
        if known is None:
            r, cols, h, end = self.fill_hashes(s, rt, full[rows])
        else:
            brow, cols, h = known
            r = np.searchsorted(rows, brow)
            end = T.num_hashed[s] + np.bincount(r, minlength=len(s))
        if len(h):
            rs = s[r]
            blocks = T.block_table[rs, cols]
            dups = self.pool.cache_blocks(blocks.tolist(), h.tolist())
            if dups and dedupe:
                idx = np.array([i for i, _ in dups])
                canon = [c for _, c in dups]
                self.pool.acquire(canon)
                self.pool.release(blocks[idx])
                T.block_table[rs[idx], cols[idx]] = canon
            counts = np.bincount(r, minlength=len(s))
            has = counts > 0
            T.last_hash[s[has]] = h[(np.cumsum(counts) - 1)[has]]
        T.num_hashed[s] = end
