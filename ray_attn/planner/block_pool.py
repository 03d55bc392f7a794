"""The paged-KV block allocator of one model replica, with hash-chained prefix caching.

Every TP rank holds the same block ids (each for its own heads), so one pool on the driver serves
them all.  A block is in exactly one of three states:

* free      - ref count 0 and no cached content;
* used      - ref count > 0 (held by one request, or by several when it is a shared prefix block);
* cached    - ref count 0 but its content is still indexed: a later request with the same prefix can
              take it back; it is evicted, least recently freed first, when the free list runs dry.

The prefix cache indexes *full* blocks by a chain hash, ``h_j = M * h_{j-1} + c_j (mod 2**64)``,
where ``c_j`` hashes the block's token ids and ``h_{-1} = ROOT_HASH``: equal hashes mean equal
prefixes up to a 64-bit collision, the same guarantee as vLLM's default (builtin-hash) prefix cache.
Being linear in the ``c_j``, the chain has a closed form, so a whole prompt (or every block a step
fills) is hashed with a few numpy calls instead of a Python loop per block.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import islice
from typing import Sequence

import numpy as np

from .errors import DoubleFreeError, OutOfBlocksError, PlannerConfigError

ROOT_HASH = 0x5EED_CA5C_0DDB_A11
_M = 0x9E37_79B9_7F4A_7C15  # odd, so invertible mod 2**64
_M_INV = pow(_M, -1, 1 << 64)
_MIX1, _MIX2 = np.uint64(0xBF58_476D_1CE4_E5B9), np.uint64(0x94D0_49BB_1331_11EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_POW: dict[int, np.ndarray] = {}


def _powers(base: int, n: int) -> np.ndarray:
    """``base**k mod 2**64`` for k in 0..n-1 (cached, grown by doubling)."""
    have = _POW.get(base)
    if have is None or len(have) < n:
        m = max(n, 2 * (0 if have is None else len(have)), 64)
        out, x = [], 1
        for _ in range(m):
            out.append(x)
            x = x * base & ((1 << 64) - 1)
        _POW[base] = have = np.array(out, dtype=np.uint64)
    return have[:n]


def content_hashes(tokens: np.ndarray) -> np.ndarray:
    """One uint64 per row of ``tokens`` [n, block_size]: splitmix64 of each token, then a weighted
    sum with per-position odd weights (all mod 2**64)."""
    x = np.asarray(tokens).astype(np.uint64)
    x ^= x >> _S30
    x *= _MIX1
    x ^= x >> _S27
    x *= _MIX2
    x ^= x >> _S31
    return (x * _powers(_M_INV * 2 + 1, x.shape[1] + 1)[1:]).sum(axis=1, dtype=np.uint64)


def chain_hashes(content: np.ndarray, counts: np.ndarray, parents: np.ndarray) -> np.ndarray:
    """Chain hashes of consecutive segments of blocks: segment r has ``counts[r]`` blocks (their
    ``content`` hashes in order) hanging off ``parents[r]``.  Uses
    ``h_k = M**k * (parent + sum_{i<=k} c_i * M**-i)`` (k counted from 1 in each segment)."""
    counts = np.asarray(counts, dtype=np.int64)
    n = len(content)
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    starts = np.cumsum(counts) - counts
    k = np.arange(n) - np.repeat(starts, counts) + 1
    top = int(counts.max()) + 1
    cs = np.cumsum(content * _powers(_M_INV, top)[k], dtype=np.uint64)
    before = np.zeros(len(counts), dtype=np.uint64)
    nz = starts > 0
    before[nz] = cs[starts[nz] - 1]
    s = cs - np.repeat(before, counts)
    return _powers(_M, top)[k] * (np.repeat(np.asarray(parents, dtype=np.uint64), counts) + s)


def prompt_hashes(token_ids, num_blocks: int, block_size: int, root: int = ROOT_HASH) -> np.ndarray:
    """Chain hashes of the first ``num_blocks`` full blocks of one token sequence, chained from
    ``root`` (a LoRA adapter's own: ``ScheduledRequest.cache_root``)."""
    if num_blocks <= 0:
        return np.zeros(0, dtype=np.uint64)
    tok = np.asarray(token_ids[: num_blocks * block_size], dtype=np.int64).reshape(num_blocks, block_size)
    return chain_hashes(content_hashes(tok), [num_blocks], [root])


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
        self._block_of: dict[int, int] = {}  # chain hash -> block id
        self._key_of: dict[int, int] = {}  # block id -> chain hash (used or cached)
        self.num_evictions = 0
        self.num_shared_blocks = 0  # blocks with two or more holders (cascade is possible)
        # The KV tiers (tiers.py) follow content leaving and entering the index: called with
        # (block ids, chain hashes) of blocks evicted, and of blocks newly indexed.
        self.on_evict = None
        self.on_index = None

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
        if n > take:  # evict the least recently freed cached blocks
            evicted = list(islice(self._evictable, n - take))
            for b in evicted:
                del self._evictable[b]
            hashes = list(map(self._key_of.pop, evicted))
            for h in hashes:
                del self._block_of[h]
            self.num_evictions += len(evicted)
            if self.on_evict is not None:
                self.on_evict(evicted, hashes)
            ids += evicted
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
            if self.ref_cnt[b] == 2:
                self.num_shared_blocks += 1

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
        self.num_shared_blocks -= int((self.ref_cnt[ids] == 2).sum())
        self.ref_cnt[ids] -= 1
        for b in ids[::-1][self.ref_cnt[ids[::-1]] == 0].tolist():
            if b in self._key_of:
                self._evictable[b] = None
            else:
                self._free.append(b)

    # ----------------------------------------------------------------------------- prefix cache
    def lookup(self, token_ids, max_blocks: int, root: int = ROOT_HASH) -> tuple[list[int], int]:
        """Read-only: the cached blocks holding the leading full blocks of ``token_ids`` (at most
        ``max_blocks``), and the chain hash of the last one (``root`` when none)."""
        if not self.enable_prefix_caching or max_blocks <= 0 or not self._block_of:
            return [], root
        hashes = prompt_hashes(token_ids, int(max_blocks), self.block_size, root).tolist()
        ids = list(map(self._block_of.get, hashes))
        n = ids.index(None) if None in ids else len(ids)
        return ids[:n], (hashes[n - 1] if n else root)

    def cached_blocks(self, hashes: Sequence[int]) -> list:
        """Read-only: the block indexed under each chain hash, None where none is."""
        if not self.enable_prefix_caching:
            return [None] * len(hashes)
        return list(map(self._block_of.get, hashes))

    def cache_blocks(self, block_ids: Sequence[int], hashes: Sequence[int]) -> list[tuple[int, int]]:
        """Index full blocks under their chain hashes.  When a hash is already indexed by another
        block (another request computed the same prefix) the older block keeps it; returns those
        duplicates as ``(position in block_ids, indexed block)`` so the caller may switch to it."""
        dups = []
        if not self.enable_prefix_caching:
            return dups
        block_of, key_of = self._block_of, self._key_of
        known = list(map(block_of.get, hashes))
        if known.count(None) == len(known) and len(set(hashes)) == len(hashes) \
                and not any(map(key_of.__contains__, block_ids)):
            block_of.update(zip(hashes, block_ids))  # the common case, all new: two C-level updates
            key_of.update(zip(block_ids, hashes))
            if self.on_index is not None:
                self.on_index(list(block_ids), list(hashes))
            return dups
        new = []
        for i, (b, h) in enumerate(zip(block_ids, hashes)):
            c = block_of.get(h)
            if c is None:
                if b not in key_of:
                    block_of[h] = b
                    key_of[b] = h
                    new.append((b, h))
            elif c != b:
                dups.append((i, c))
        if new and self.on_index is not None:
            self.on_index(*map(list, zip(*new)))
        return dups

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
        assert self.num_shared_blocks == int((self.ref_cnt >= 2).sum())
