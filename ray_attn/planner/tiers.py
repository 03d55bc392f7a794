"""KV tiers below the device cache: a host-memory tier per rank, and a store shared by replicas.

The device pool (block_pool.py) forgets a cached block when it evicts it.  With tiers on, the
planner keeps track of where else a block's content lives, by the same chain hash:

* **host** -- each rank holds a pool of host slots (pinned on GPUs) for its shard; slot ids are
  the same on every rank, as block ids are, so one ``HostTier`` on the driver decides for all.
  A cached block the device pool evicts is copied to a host slot (write-back: only what leaves
  the device) before the step's forward reuses it; a later prefix hit there is copied back into a
  fresh device block before the forward that reads it.  The host copy stays (the tiers are
  inclusive), so a block evicted twice is copied out once.  LRU within the tier.
* **shared** -- every full block a replica computes is published, by its ranks, to the store
  actor of their node (``runtime/kv_store.py``), keyed by (layout, hash); a replica that misses
  both its own tiers asks the stores (``SharedKVClient``, injected by the engine: the planner
  itself never touches Ray) and its ranks fetch the run a store holds, when the run is long
  enough to pay for the fetch (``min_shared_tokens``, measured by scripts/bench_kv_tiers.py).

A prefix hit is looked up tier by tier: the device pool (and the blocks this step computes),
then the host tier, then the shared stores; each later tier continues the run where the one
before stopped.  What a step must copy travels with its plan (``KVTransfers``), and the ranks
do it in an order that makes every copy read what the planner meant: copies out of device blocks
first (a block evicted this step still holds its old content), then host -> device, then the
store's blocks.  A host slot read this step is pinned, so no copy out of this step overwrites it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

HOST, SHARED = "host", "shared"
_EMPTY = np.zeros(0, np.int32)


@dataclass
class KVTransfers:
    """The copies one step makes before its forward, on every rank (see the module docstring)."""

    offload_blocks: np.ndarray = field(default_factory=lambda: _EMPTY)  # int32 device blocks ...
    offload_slots: np.ndarray = field(default_factory=lambda: _EMPTY)  # ... copied to these host slots
    onload_slots: np.ndarray = field(default_factory=lambda: _EMPTY)  # int32 host slots ...
    onload_blocks: np.ndarray = field(default_factory=lambda: _EMPTY)  # ... copied into these blocks
    fetch_blocks: np.ndarray = field(default_factory=lambda: _EMPTY)  # int32 blocks filled from a store
    fetch_hashes: list = field(default_factory=list)  # their chain hashes (python ints)
    fetch_stores: list = field(default_factory=list)  # the name of the store actor holding each
    publish_blocks: np.ndarray = field(default_factory=lambda: _EMPTY)  # int32 blocks computed earlier ...
    publish_hashes: list = field(default_factory=list)  # ... published under these hashes
    layout: str | None = None  # what replicas must share to mix blocks (kv_store.layout_key)

    @property
    def empty(self) -> bool:
        return not (len(self.offload_blocks) or len(self.onload_blocks) or len(self.fetch_blocks)
                    or len(self.publish_blocks))


class SharedLookup(Protocol):
    """What the planner needs of ``runtime.kv_store.SharedKVClient``."""

    def lookup(self, hashes: list[int]) -> tuple[int, str | None, str | None]: ...

    def release(self, store_name: str, lease: str) -> None: ...


class HostTier:
    """Which chain hash each host slot holds, LRU first; slots pinned for the step being planned."""

    def __init__(self, num_slots: int):
        self.num_slots = int(num_slots)
        self._slot_of: dict[int, int] = {}
        self._key_of: dict[int, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # slots holding content, LRU first
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._pinned: set[int] = set()
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._lru)

    def leading(self, hashes) -> list[int]:
        """Read-only: the slots holding the leading run of ``hashes``."""
        out = []
        for h in hashes:
            s = self._slot_of.get(h)
            if s is None:
                break
            out.append(s)
        return out

    def take(self, slots) -> None:
        """Slots read this step: pinned until ``unpin_all``, and the most recently used."""
        for s in slots:
            self._lru.move_to_end(s)
            self._pinned.add(s)

    def store(self, h: int) -> int | None:
        """A slot for content ``h`` leaving the device: None when the tier holds it already (no
        copy needed) or every slot is pinned (the block is dropped: a full tier never refuses)."""
        s = self._slot_of.get(h)
        if s is not None:
            self._lru.move_to_end(s)
            return None
        if self._free:
            s = self._free.pop()
        else:
            s = next((x for x in self._lru if x not in self._pinned), None)
            if s is None:
                return None
            del self._slot_of[self._key_of.pop(s)]
            del self._lru[s]
            self.num_evictions += 1
        self._slot_of[h], self._key_of[s] = s, h
        self._lru[s] = None
        self._pinned.add(s)  # written this step: no later copy of the step may take it
        return s

    def unpin_all(self) -> None:
        self._pinned.clear()

    def reset(self) -> None:
        self.__init__(self.num_slots)

    def check_invariants(self) -> None:
        assert set(self._lru) == set(self._key_of) and len(self._lru) + len(self._free) == self.num_slots
        assert all(self._slot_of[h] == s for s, h in self._key_of.items())
        assert not set(self._free) & set(self._lru)


@dataclass
class TierStats:
    """Blocks by tier and direction since the engine started (bytes: times the rank's block bytes)."""

    host_hit_blocks: int = 0
    shared_hit_blocks: int = 0
    offloaded_blocks: int = 0  # device -> host
    onloaded_blocks: int = 0  # host -> device
    offload_steps: int = 0  # steps that offloaded: blocks per step is the size of a rank's copies
    onload_steps: int = 0
    fetched_blocks: int = 0  # store -> device
    published_blocks: int = 0  # device -> store
    host_dropped_blocks: int = 0  # evicted from the device with the host tier full and pinned
    shared_lookups: int = 0
    shared_declined_blocks: int = 0  # runs a store held, too short to pay for the fetch


class KVTiers:
    """The planner's side of the tiers: lookups past the device pool, the step's copies, leases."""

    def __init__(self, host_slots: int = 0, shared: SharedLookup | None = None, layout: str | None = None,
                 min_shared_tokens: int = 0, block_size: int = 16, max_shared_tokens: int | None = None):
        self.host = HostTier(host_slots) if host_slots > 0 else None
        self.shared = shared
        self.layout = layout
        # a shared run is fetched only inside this window of lengths (the measured break-evens)
        self.min_shared_blocks = -(-int(min_shared_tokens) // int(block_size))
        self.max_shared_blocks = None if max_shared_tokens is None else int(max_shared_tokens) // int(block_size)
        self.stats = TierStats()
        self._memo: dict[tuple, tuple[int, str | None, str | None]] = {}  # this step's store answers
        self._used_leases: set = set()
        self._held_leases: list[list] = [[], []]  # leases of the last two steps (their fetches may run)
        self._pending_publish: list[tuple[int, int]] = []  # indexed by this plan: next plan's
        self._clear_step()

    def _clear_step(self) -> None:
        self._offload: list[tuple[int, int]] = []
        self._onload: list[tuple[int, int]] = []
        self._fetch: list[tuple[int, int, str]] = []  # (hash, block, store)
        self._publish: list[tuple[int, int]] = []
        self._no_publish: set[int] = set()  # blocks filled from a tier this step

    def stats_dict(self) -> dict:
        """The counters, and what the host tier holds now (for the planner's ``stats``)."""
        from dataclasses import asdict

        return asdict(self.stats) | {"host_tier_blocks": 0 if self.host is None else len(self.host),
                                     "host_tier_slots": 0 if self.host is None else self.host.num_slots}

    # -- lookups (read-only for the host tier; the store pins what it answers under a lease) ----
    def leading(self, hashes: list[int]) -> list[tuple[str, object]]:
        """The tier hits continuing a device run: ``(HOST, slot)`` then ``(SHARED, store)`` per
        block, for the leading run of ``hashes`` the tiers hold."""
        out: list[tuple[str, object]] = []
        if self.host is not None:
            out = [(HOST, s) for s in self.host.leading(hashes)]
        rest = hashes[len(out):]
        if self.shared is not None and rest and len(rest) >= self.min_shared_blocks:
            n, store, _ = self._ask_store(rest)
            too_long = self.max_shared_blocks is not None and n > self.max_shared_blocks
            if n and n >= self.min_shared_blocks and not too_long:
                out += [(SHARED, store)] * n
            elif n:
                self.stats.shared_declined_blocks += n
        return out

    def _ask_store(self, hashes: list[int]):
        key = (hashes[0], len(hashes))
        got = self._memo.get(key)
        if got is None:
            self.stats.shared_lookups += 1
            got = self._memo[key] = self.shared.lookup(hashes)
        return got

    # -- what admission and allocation change ---------------------------------------------------
    def begin_plan(self) -> None:
        """A plan call starts: blocks indexed before it (by earlier plans or by freeing
        requests) hold what earlier steps computed, so this step may publish them."""
        self._publish += self._pending_publish
        self._pending_publish = []

    def pin(self, hits: list[tuple[str, object]]) -> None:
        """Host slots about to be read this step: no copy out of the step may overwrite them."""
        if self.host is not None:
            self.host.take([src for kind, src in hits if kind == HOST])

    def claim(self, hits: list[tuple[str, object]], blocks, hashes) -> None:
        """Fresh device ``blocks`` take tier hits ``hits`` (with their chain ``hashes``)."""
        for (kind, src), b, h in zip(hits, blocks, hashes):
            self._no_publish.add(b)
            if kind == HOST:
                self.host.take([src])
                self._onload.append((src, b))
                self.stats.host_hit_blocks += 1
            else:
                self._fetch.append((h, b, src))
                self.stats.shared_hit_blocks += 1
                self._used_leases.add(src)

    def evicted(self, blocks, hashes) -> None:
        """The device pool evicted cached ``blocks``: their content goes to the host tier."""
        if self.host is None:
            return
        for b, h in zip(blocks, hashes):
            s = self.host.store(h)
            if s is not None:
                self._offload.append((b, s))
            elif h not in self.host._slot_of:
                self.stats.host_dropped_blocks += 1

    def indexed(self, blocks, hashes) -> None:
        """The device pool indexed new content: published by the step after this one's forward."""
        if self.shared is not None:
            self._pending_publish += [(b, h) for b, h in zip(blocks, hashes) if b not in self._no_publish]

    def has_pending_publish(self) -> bool:
        return bool(self._pending_publish or self._publish)

    def take_transfers(self) -> KVTransfers | None:
        """The copies of the plan just built (None: none); the step's pins and store answers end."""
        t = None
        # A block queued for publishing that this step re-fills from a tier is left out: its old
        # content would still be read first (copies out run first), but it is a share not worth a copy.
        publish = [(b, h) for b, h in self._publish if b not in self._no_publish]
        if self._offload or self._onload or self._fetch or publish:
            t = KVTransfers(layout=self.layout)
            if self._offload:
                t.offload_blocks, t.offload_slots = (np.array(x, np.int32) for x in zip(*self._offload))
            if self._onload:
                t.onload_slots, t.onload_blocks = (np.array(x, np.int32) for x in zip(*self._onload))
            if self._fetch:
                t.fetch_hashes = [h for h, _, _ in self._fetch]
                t.fetch_blocks = np.array([b for _, b, _ in self._fetch], np.int32)
                t.fetch_stores = [s for _, _, s in self._fetch]
            if publish:
                t.publish_blocks = np.array([b for b, _ in publish], np.int32)
                t.publish_hashes = [h for _, h in publish]
            s = self.stats
            s.offloaded_blocks += len(self._offload)
            s.onloaded_blocks += len(self._onload)
            s.offload_steps += bool(self._offload)
            s.onload_steps += bool(self._onload)
            s.fetched_blocks += len(self._fetch)
            s.published_blocks += len(publish)
        self._end_step()
        return t

    def _end_step(self) -> None:
        if self.host is not None:
            self.host.unpin_all()
        # A lease this step fetches under is held two more steps (the ranks fetch while the
        # step runs); the others are released now.
        old = self._held_leases.pop(0)
        self._held_leases.append([])
        for n, store, lease in self._memo.values():
            if lease is None:
                continue
            if store in self._used_leases and n:
                self._held_leases[-1].append((store, lease))
            else:
                old.append((store, lease))
        for store, lease in old:
            self.shared.release(store, lease)
        self._memo.clear()
        self._used_leases.clear()
        self._clear_step()

    def reset(self) -> None:
        """The ranks restarted: their host tiers and device blocks are gone (the stores are not)."""
        if self.host is not None:
            self.host.reset()
        self._pending_publish = []
        self._memo.clear()
        self._used_leases.clear()
        self._clear_step()
