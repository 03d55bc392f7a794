"""The paged-KV block allocator of one model replica, with hash-chained prefix caching.

Every TP rank holds the same block ids (each for its own heads), so one pool on the driver serves
them all.  A block is in exactly one of three states:

* free      - ref count 0 and no cached content;
* used      - ref count > 0 (held by one request, or by several when it is a shared prefix block);
* cached    - ref count 0 but its full-block content is still indexed: a later request with the same
              prefix can take it back; it is evicted, least recently freed first, when the free list
              runs dry.

The prefix cache indexes *full* blocks by ``key = (parent_hash, block_token_ids)`` where
``parent_hash`` is the hash of the previous block's key (``ROOT_HASH`` for block 0), as vLLM's
automatic prefix caching does.  The dict compares keys by equality, so a hit at one level is exact;
across levels the chain relies on Python's 64-bit tuple hash (a collision needs two different
prefixes whose 64-bit chain hashes agree).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import numpy as np

from .errors import DoubleFreeError, OutOfBlocksError, PlannerConfigError

ROOT_HASH = 0x5EED_CA5C


def block_key(parent_hash: int, tokens) -> tuple:
    """The prefix-cache key of one full block."""
    if isinstance(tokens, np.ndarray):
        tokens = tokens.tolist()
    return (parent_hash, tuple(tokens))


class BlockPool:
    """Free list, ref counts and the prefix cache over ``num_blocks`` blocks of ``block_size``."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if int(num_blocks) <= 0:
            raise PlannerConfigError(f"num_blocks must be positive, got {num_blocks}")
        if int(block_size) <= 0:
            raise PlannerConfigError(f"block_size must be positive, got {block_size}")
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.ref_cnt = np.zeros(self.num_blocks, dtype=np.int32)
        # A stack popped from the end, so the lowest ids go out first (deterministic tests).
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._block_of: dict[tuple, int] = {}  # key -> block id
        self._key_of: dict[int, tuple] = {}  # block id -> key (used or cached)
        self.num_evictions = 0

    # ----------------------------------------------------------------------------- counts
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: the free ones plus the evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_uncached_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with ref count 0 whose content is still indexed (evictable)."""
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._evictable

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._key_of

    # ----------------------------------------------------------------------------- allocation
    def allocate(self, n: int) -> np.ndarray:
        """Take ``n`` blocks (ref count 1 each).  Raises OutOfBlocksError and changes nothing when
        fewer than ``n`` are free or evictable."""
        n = int(n)
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > self.num_free_blocks:
            raise OutOfBlocksError(n, self.num_free_blocks)
        take = min(n, len(self._free))
        ids = self._free[len(self._free) - take :]
        del self._free[len(self._free) - take :]
        ids.reverse()
        for _ in range(n - take):  # evict least recently freed cached blocks
            b, _ = self._evictable.popitem(last=False)
            del self._block_of[self._key_of.pop(b)]
            self.num_evictions += 1
            ids.append(b)
        out = np.asarray(ids, dtype=np.int32)
        self.ref_cnt[out] = 1
        return out

    def acquire(self, block_ids: Sequence[int]) -> None:
        """Add one reference to each block (a prefix-cache hit); revives evictable ones."""
        for b in block_ids:
            b = int(b)
            if self.ref_cnt[b] == 0:
                if b not in self._evictable:
                    raise DoubleFreeError(f"block {b} is free and holds no cached content")
                del self._evictable[b]
            self.ref_cnt[b] += 1

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block.  Blocks that reach zero go to the cache (when they
        hold indexed content) or the free list.  The request's tail blocks are released first so
        that they are evicted before the prefix blocks they hang off (vLLM's order)."""
        ids = np.asarray(block_ids, dtype=np.int64)
        if ids.size == 0:
            return
        if np.unique(ids).size != ids.size:
            raise DoubleFreeError(f"blocks released twice in one call: {ids.tolist()}")
        if (self.ref_cnt[ids] <= 0).any():
            bad = ids[self.ref_cnt[ids] <= 0].tolist()
            raise DoubleFreeError(f"blocks {bad} are already free")
        self.ref_cnt[ids] -= 1
        for b in ids[::-1][self.ref_cnt[ids[::-1]] == 0].tolist():
            if b in self._key_of:
                self._evictable[b] = None
            else:
                self._free.append(b)

    # ----------------------------------------------------------------------------- prefix cache
    def lookup(self, token_ids, max_blocks: int) -> tuple[list[int], list[int]]:
        """Read-only: the cached blocks holding the leading full blocks of ``token_ids`` (at most
        ``max_blocks``), and their chain hashes.  Stops at the first miss."""
        ids: list[int] = []
        hashes: list[int] = []
        if not self.enable_prefix_caching or max_blocks <= 0:
            return ids, hashes
        bs = self.block_size
        parent = ROOT_HASH
        for j in range(int(max_blocks)):
            key = block_key(parent, token_ids[j * bs : (j + 1) * bs])
            b = self._block_of.get(key)
            if b is None:
                break
            ids.append(b)
            parent = hash(key)
            hashes.append(parent)
        return ids, hashes

    def cache(self, block_id: int, key: tuple) -> int:
        """Index a full, used block under ``key``; returns the chain hash for the next block.  When
        another block already holds that content the index keeps the older one."""
        if self.enable_prefix_caching and key not in self._block_of and block_id not in self._key_of:
            self._block_of[key] = block_id
            self._key_of[block_id] = key
        return hash(key)

    def touch_lru(self, block_ids: Sequence[int]) -> None:
        """Mark evictable blocks as recently used (a lookup that will be claimed soon)."""
        for b in block_ids:
            if b in self._evictable:
                self._evictable.move_to_end(b)

    def reset_prefix_cache(self) -> int:
        """Forget every evictable cached block (they become free); returns how many."""
        n = len(self._evictable)
        for b in self._evictable:
            del self._block_of[self._key_of.pop(b)]
            self._free.append(b)
        self._evictable.clear()
        return n

    # ----------------------------------------------------------------------------- checking
    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent (for tests)."""
        free = set(self._free)
        cached = set(self._evictable)
        used = set(np.flatnonzero(self.ref_cnt > 0).tolist())
        assert len(free) == len(self._free), "duplicate ids in the free list"
        assert not (free & cached) and not (free & used) and not (cached & used)
        assert len(free) + len(used) + len(cached) == self.num_blocks
        assert (self.ref_cnt >= 0).all(), "negative ref count"
        assert cached <= set(self._key_of), "an evictable block without cached content"
        assert not (free & set(self._key_of)), "a free block still indexed"
        assert all(self._block_of[k] == b for b, k in self._key_of.items())
