"""Prefix-cache hits on the blocks that the same step computes (the ``n`` samples of one prompt).

vLLM v1 caches a full block's hash when it allocates the block, so a request scheduled later in
the same pass hits the blocks an earlier request of that pass is about to compute.  That is sound
because within one forward every layer writes the whole step's K/V into the cache
(``reshape_and_cache_flash``) before its attention reads it: a row may read blocks that another row
writes in the same step.

Here blocks enter the prefix cache once the step's plan is built
(``KVCacheManager.index_filled_blocks``), too late for the step's own requests.  ``StepPrefixIndex``
is the view in between: the chain hashes of the full blocks the step's rows will have computed once
it ran -- only those: a chunk that leaves a block part-filled shares nothing of it -- each with the
row and block-table column that computes it.  A new row looks each leading block up in the pool
first, then here; what it finds here is a hit like any other (the row computes only what follows),
resolved to a block id once the computing row's blocks are allocated.

Rows already running contribute what they fill wherever they sit in the batch (their lengths are
fixed); a new row contributes to the rows after it, since what it fills depends on its own hit.
The scheduler and the planner build the index from the same rows in the same order, so the
``num_new_tokens`` the scheduler proposes (shrunk by the hit, which frees token budget) is what the
planner then finds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .block_pool import ROOT_HASH, BlockPool, prompt_hashes
from .errors import InvalidRequestError
from .slots import RequestTable
from .tiers import KVTiers


class BlockIndexOwner(Protocol):
    """What the index reads of the manager that owns it (``KVCacheManager``, which imports this
    module): named here, so that the two modules do not import each other."""

    block_size: int
    table: RequestTable
    pool: BlockPool
    tiers: KVTiers | None

    def fill_hashes(self, slots, toks, full): ...

    def max_hit_blocks(self, num_tokens: int, num_new_tokens: int | None) -> int: ...


@dataclass(slots=True)
class PrefixMatch:
    """A new row's hit: its leading blocks found in the pool or computed by an earlier row."""

    hashes: np.ndarray  # uint64 chain hashes of the tokens' full blocks, up to any unknown token
    blocks: list  # per hit block, its pool block id, or -1 where a row of this step computes it
    step_hits: list  # (column, computing row, that row's column) for each -1 of ``blocks``
    num_tokens: int  # the hit in tokens: whole blocks
    # (column, tier, source) for each -2 of ``blocks``: a block a lower tier holds (tiers.py),
    # copied into a fresh device block when the row is admitted; always the run's last columns
    tier_hits: list = None
    root: int = ROOT_HASH  # the chains' root (a LoRA adapter's own)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def last_hash(self) -> int:
        """The chain hash of the last hit block (``root`` when none): where the row's own
        indexing goes on from."""
        return int(self.hashes[len(self.blocks) - 1]) if self.blocks else self.root


class StepPrefixIndex:
    """The full blocks one step computes, by chain hash (see the module docstring)."""

    __slots__ = ("kv", "block_size", "_filled", "_parts")

    def __init__(self, kv: BlockIndexOwner):
        self.kv = kv
        self.block_size = kv.block_size
        self._filled: dict[int, tuple[int, int]] = {}  # chain hash -> (row, column) computing it
        self._parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # for ``filled_blocks``

    def add_running(self, rows, slots: np.ndarray, toks: list, ends: np.ndarray) -> None:
        """Rows already admitted (table rows ``slots``), holding ``ends[i]`` tokens once the step
        ran: their full blocks not indexed yet.  The first row to compute a content keeps it, as
        ``BlockPool.cache_blocks`` keeps the first block indexed under a hash."""
        full = np.asarray(ends, np.int64) // self.block_size
        grow = np.flatnonzero(full > self.kv.table.num_hashed[slots])  # most decode rows: none
        if not len(grow):
            return
        try:
            r, cols, h, _ = self.kv.fill_hashes(slots[grow], [toks[i] for i in grow.tolist()], full[grow])
        except (TypeError, ValueError, OverflowError) as e:
            raise InvalidRequestError(f"token ids must be ints: {e}") from None
        rows = np.asarray(rows, np.int64)[grow[r]]
        self._parts.append((rows, cols, h))
        filled = self._filled
        for key, row, col in zip(h.tolist(), rows.tolist(), cols.tolist()):
            filled.setdefault(key, (row, col))

    def match(self, token_ids, num_new_tokens: int | None = None, read: bool = True,
              root: int = ROOT_HASH) -> PrefixMatch:
        """The longest run of ``token_ids``'s leading full blocks that the pool holds or an earlier
        row computes, capped as ``KVCacheManager.max_hit_blocks`` caps a prefix-cache hit (the last
        token is always computed; an explicit ``num_new_tokens`` must fit).  With ``read`` False
        the hit is empty (``ScheduledRequest.skip_prefix_cache``), but the hashes are still what
        ``add_new`` indexes for the rows after it."""
        bs = self.block_size
        n = len(token_ids)
        full = n // bs
        try:
            tok = np.asarray(token_ids[: full * bs], dtype=np.int64).reshape(full, bs)
        except (TypeError, ValueError, OverflowError) as e:
            raise InvalidRequestError(f"token_ids must be sequences of ints: {e}") from None
        if full and tok.min() < 0:  # an unknown token (async scheduling): hash only what precedes it
            full = int(np.flatnonzero((tok < 0).any(axis=1))[0])
        hashes = prompt_hashes(tok[:full].reshape(-1), full, bs, root)
        limit = min(self.kv.max_hit_blocks(n, num_new_tokens), full) if read else 0
        keys = hashes[:limit].tolist()
        filled = self._filled
        blocks, step_hits, tier_hits = [], [], []
        for col, (key, b) in enumerate(zip(keys, self.kv.pool.cached_blocks(keys))):
            if b is None:
                src = filled.get(key)
                if src is None:
                    break
                b = -1
                step_hits.append((col, *src))
            blocks.append(b)
        tiers = self.kv.tiers
        if tiers is not None and len(blocks) < len(keys):  # the lower tiers go on where it stopped
            for col, (kind, src) in enumerate(tiers.leading(keys[len(blocks):]), len(blocks)):
                tier_hits.append((col, kind, src))
                blocks.append(-2)
        return PrefixMatch(hashes, blocks, step_hits, len(blocks) * bs, tier_hits, root)

    def add_new(self, row: int, m: PrefixMatch, num_new_tokens: int) -> None:
        """Batch row ``row``, admitted with the hit ``m`` and computing ``num_new_tokens`` past it:
        the blocks it fills become hits for the rows after it."""
        filled = self._filled
        for col, _, _ in m.tier_hits or ():  # a later row takes what this one copies in
            filled.setdefault(int(m.hashes[col]), (row, col))
        end = min((m.num_tokens + int(num_new_tokens)) // self.block_size, len(m.hashes))
        if end <= m.num_blocks:
            return
        h = m.hashes[m.num_blocks: end]
        self._parts.append((np.full(len(h), row, np.int64), np.arange(m.num_blocks, end), h))
        for col, key in enumerate(h.tolist(), m.num_blocks):
            filled.setdefault(key, (row, col))

    def filled_blocks(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every block the rows fill, not only the first of each content: (row, column, chain
        hash), by row.  The planner indexes them once the step is planned, without hashing again:
        they are what ``KVCacheManager.fill_hashes`` finds then."""
        if not self._parts:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.uint64)
        rows, cols, h = (np.concatenate(x) for x in zip(*self._parts))
        order = np.argsort(rows, kind="stable")
        return rows[order], cols[order], h[order]
