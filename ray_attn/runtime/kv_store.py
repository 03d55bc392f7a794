"""A KV-cache tier shared between replicas (issue 26): one store actor per node.

Each TP rank of a replica publishes its shard (its KV heads) of every full block it computed,
keyed by ``(layout, chain hash)``; a replica with the same model and TP layout that misses a
prefix locally asks the stores how many leading blocks of its prompt they hold, and its ranks
fetch those shards instead of recomputing them.

Why it is shaped this way:

- The store copies every shard it keeps into an object of its own (``ray.put`` here, so the store
  is the owner).  A large actor-call argument lives in the object store and is owned by the
  *caller*; a view of it would tie the block to the replica that published it, and a replica that
  dies must take none of the other replicas' hits with it.
- A fetch gets object refs, not bytes: ``get`` answers with the shards' refs, and the rank reads
  them straight out of its node's object store (zero-copy on the store's node; Ray's object
  manager pulls them across nodes).  Returning the bytes made this actor, which serves every
  replica of the node, serialize a copy of every row into the reply (76 ms for 128 MiB on the
  H200 host, 2026-12-02), one fetch at a time.
- Object-store pressure drops a shard (``ObjectStoreFullError`` on put counts as dropped), never
  blocks a step: the put runs here, not on a rank.
- It is a cache, never a queue: a put past capacity evicts least-recently-used unpinned entries
  and drops what still does not fit (it returns how many rows it kept).  A step never waits on it.
- A lookup pins what it counted under a lease, so the blocks a replica was promised are still
  there when its ranks fetch them a moment later; leases expire, so a replica that dies between
  lookup and fetch pins nothing for long.
- Blocks are chains: a lookup stops at the first gap, so a block is useless without the ones
  before it.  Rows are touched last-to-first, which makes a chain's tail older than its head and
  eviction eat chains from the end.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter, OrderedDict

import numpy as np
import ray
from ray.actor import ActorHandle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

STORE_NAMESPACE = "ray_attn"
LEASE_TTL_S = 120.0
# How long a client trusts its list of nodes, and waits for the stores' answers to a lookup.
STORES_REFRESH_S = 5.0
LOOKUP_TIMEOUT_S = 3.0
# Threads of a store actor: a put's copies must not hold up lookups, which a step's planning waits for.
STORE_THREADS = 4


def store_name(node_id: str) -> str:
    return f"ray_attn_kv_store:{node_id}"


class _Entry:
    __slots__ = ("shards", "nbytes")

    def __init__(self, tp: int):
        self.shards: list[ray.ObjectRef | None] = [None] * tp  # objects this store owns
        self.nbytes = 0

    def complete(self) -> bool:
        return all(s is not None for s in self.shards)


class BlockStore:
    """The store's state and rules; the actor is ``KVBlockStore`` (this class under ``ray.remote``)."""

    def __init__(self, capacity_bytes: int, lease_ttl_s: float = LEASE_TTL_S):
        self.capacity_bytes = int(capacity_bytes)
        self.lease_ttl_s = float(lease_ttl_s)
        self._entries: OrderedDict[tuple[str, int], _Entry] = OrderedDict()  # LRU first
        self._leases: dict[str, tuple[float, list[tuple[str, int]]]] = {}
        # Released leases, kept one TTL: calls run on several threads, so a client's release may
        # run before the lookup it answers (a slow store's); that lookup must then pin nothing.
        # Only leases that pinned nothing here are kept, oldest first (the sweep stops at the first
        # one young enough).
        self._released: OrderedDict[str, float] = OrderedDict()
        self._pins: Counter[tuple[str, int]] = Counter()
        self._bytes = 0
        self._counts = Counter(puts=0, dropped=0, evicted=0, hits=0, lookups=0)
        # Calls run on several threads (max_concurrency): the state under one lock, a put's
        # copies outside it; (key, rank) rows whose copy is under way, their bytes reserved
        self._lock = threading.Lock()
        self._copying: set[tuple[tuple[str, int], int]] = set()

    def put(self, layout: str, rank: int, tp: int, hashes: list[int], data: np.ndarray) -> int:
        """Keep ``rank``'s rows ``data`` [len(hashes), block_bytes] of ``hashes``; returns how many
        leading rows the store now holds.  The copies run outside the lock: lookups and gets from
        other replicas go on meanwhile (a 2,048-token prefix is 128 copies of 2 MiB for an 8B
        model), and a row is visible only once copied."""
        data = np.asarray(data)
        if not 0 <= rank < tp:
            raise ValueError(f"rank {rank} is not in [0, tp={tp})")
        if data.dtype != np.uint8 or data.ndim != 2 or data.shape[0] != len(hashes):
            raise ValueError(f"data must be uint8 [len(hashes)={len(hashes)}, block_bytes], "
                             f"got {data.dtype} {list(data.shape)}")
        keys = [(layout, int(h)) for h in hashes]
        need = data.shape[1]
        with self._lock:
            self._sweep()
            held, todo = 0, []  # rows already there; rows to copy, their bytes reserved
            protected = set(keys)  # never evict this call's own rows to make room for its later ones
            victims = None
            for i, key in enumerate(keys):
                entry = self._entries.get(key)
                if entry is not None and len(entry.shards) != tp:
                    raise ValueError(f"{key} was put with tp={len(entry.shards)}, now tp={tp}")
                if (entry is not None and entry.shards[rank] is not None) or (key, rank) in self._copying:
                    held += 1  # already held (or on its way): nothing to copy
                    continue
                if self._bytes + need > self.capacity_bytes:
                    if victims is None:
                        victims = iter(list(self._entries))
                    self._evict_for(need, victims, protected)
                if self._bytes + need > self.capacity_bytes:
                    # A lookup stops at this gap, so the rows after it could only take room.
                    self._counts["dropped"] += len(keys) - i
                    break
                self._bytes += need
                self._copying.add((key, rank))
                todo.append((i, key))
        refs = {}
        for i, key in todo:
            try:
                refs[key] = ray.put(np.ascontiguousarray(data[i]))  # a copy the store owns, not the caller's
            except ray.exceptions.ObjectStoreFullError:
                break  # object-store pressure: drop the rest, never wait for room
        with self._lock:
            for _, key in todo:
                self._copying.discard((key, rank))
                ref = refs.get(key)
                if ref is None:
                    self._bytes -= need
                    self._counts["dropped"] += 1
                    continue
                entry = self._entries.get(key)
                if entry is None:
                    entry = self._entries[key] = _Entry(tp)
                entry.shards[rank] = ref
                entry.nbytes += need
                self._counts["puts"] += 1
            self._touch(keys)
        return held + len(refs)

    def lookup(self, layout: str, hashes: list[int], lease: str) -> int:
        with self._lock:
            self._sweep()
            self._counts["lookups"] += 1
            keys = []
            for h in hashes:
                entry = self._entries.get((layout, int(h)))
                if entry is None or not entry.complete():
                    break
                keys.append((layout, int(h)))
            if keys and lease not in self._released:
                _, held = self._leases.get(lease, (0.0, []))
                self._leases[lease] = (time.monotonic(), held + keys)
                self._pins.update(keys)
                self._touch(keys)
            return len(keys)

    def get(self, layout: str, rank: int, hashes: list[int]) -> list[ray.ObjectRef]:
        """The refs of ``rank``'s rows of ``hashes`` (the caller ``ray.get``s them: the bytes never
        pass through this actor again).  The caller borrows each object until it drops the ref,
        so an eviction here cannot pull a row out from under a fetch in flight."""
        with self._lock:
            self._sweep()
            rows = []
            for h in hashes:
                entry = self._entries.get((layout, int(h)))
                shard = entry.shards[rank] if entry is not None and rank < len(entry.shards) else None
                if shard is None:
                    raise KeyError(f"no shard for (layout={layout!r}, hash={int(h)}, rank={rank})")
                rows.append(shard)
            self._touch([(layout, int(h)) for h in hashes])
            self._counts["hits"] += len(rows)
            return rows

    def release(self, lease: str) -> None:
        with self._lock:
            if lease in self._leases:
                self._unpin(lease)
            else:
                self._released[lease] = time.monotonic()
            self._sweep()

    def stats(self) -> dict:
        """``borrowed`` counts shards held as anything but an object this store put (always 0).
        Reading the bytes back cannot tell a view of the caller's argument from a copy: the view
        alone keeps a dead publisher's buffer mapped, outside the store's own memory and accounting."""
        with self._lock:
            self._sweep()
            shards = [s for e in self._entries.values() for s in e.shards if s is not None]
            copying = len(self._copying)
        return {
            "copying": copying,
            "borrowed": sum(not isinstance(s, ray.ObjectRef) for s in shards),
            "entries": len(self._entries),
            "complete": sum(e.complete() for e in self._entries.values()),
            "bytes": self._bytes,
            "capacity_bytes": self.capacity_bytes,
            "leases": len(self._leases),
            "released_leases": len(self._released),
            "pinned": len(self._pins),
            **self._counts,
        }

    def clear(self, layout: str | None = None) -> int:
        with self._lock:
            keys = [k for k in self._entries if layout is None or k[0] == layout]
            for key in keys:
                self._bytes -= self._entries.pop(key).nbytes
            return len(keys)

    # -- internals
    def _touch(self, keys: list[tuple[str, int]]) -> None:
        for key in reversed(keys):  # the chain's head ends most recent: tails are evicted first
            if key in self._entries:
                self._entries.move_to_end(key)

    def _evict_for(self, need: int, victims, protected: set) -> None:
        for key in victims:
            if self._bytes + need <= self.capacity_bytes:
                return
            if key in protected or self._pins[key] > 0 or key not in self._entries:
                continue
            self._bytes -= self._entries.pop(key).nbytes
            self._counts["evicted"] += 1

    def _unpin(self, lease: str) -> None:
        _, keys = self._leases.pop(lease, (0.0, []))
        self._pins.subtract(keys)
        for key in keys:
            if self._pins[key] <= 0:
                self._pins.pop(key, None)

    def _sweep(self) -> None:
        deadline = time.monotonic() - self.lease_ttl_s
        for lease in [k for k, (t, _) in self._leases.items() if t < deadline]:
            self._unpin(lease)
        while self._released and next(iter(self._released.values())) < deadline:
            self._released.popitem(last=False)


KVBlockStore = ray.remote(num_cpus=0, max_concurrency=STORE_THREADS)(BlockStore)


# ------------------------------------------------------------------ finding the stores
_node_stores: dict[str, ActorHandle] = {}
_named: dict[str, ActorHandle] = {}


def node_store(node_id: str | None = None, capacity_bytes: int = 4 << 30) -> ActorHandle:
    """The store actor of a node (default: the caller's), created if missing.  Detached, so it
    outlives the replica that created it; pinned to its node, since it serves that node's ranks."""
    node_id = node_id or ray.get_runtime_context().get_node_id()
    handle = _node_stores.get(node_id)
    if handle is None:
        handle = KVBlockStore.options(
            name=store_name(node_id), namespace=STORE_NAMESPACE, lifetime="detached",
            get_if_exists=True,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(capacity_bytes)
        _node_stores[node_id] = handle
    return handle


def get_store(name: str) -> ActorHandle:
    handle = _named.get(name)
    if handle is None:
        handle = _named[name] = ray.get_actor(name, namespace=STORE_NAMESPACE)
    return handle


def forget_store(name: str) -> None:
    """Drop cached handles of a store that died, so the next call finds or creates a live one."""
    _named.pop(name, None)
    for node_id in [n for n in _node_stores if store_name(n) == name]:
        del _node_stores[node_id]


class SharedKVClient:
    """The driver side of one replica: which stores to ask, and leases.

    ``stores`` fixes the list of (name, handle) to ask instead of one store per alive node (tests).
    """

    def __init__(self, layout: str, tp: int, capacity_bytes: int = 4 << 30,
                 stores: list[tuple[str, ActorHandle]] | None = None,
                 timeout_s: float | None = None):
        self.layout = layout
        self.tp = tp
        self.capacity_bytes = capacity_bytes
        self.timeout_s = LOOKUP_TIMEOUT_S if timeout_s is None else timeout_s  # read now: tests stretch it
        self._fixed = list(stores) if stores is not None else None
        self._stores: list[tuple[str, ActorHandle]] = []
        self._stores_at = -float("inf")

    def stores(self) -> list[tuple[str, ActorHandle]]:
        if self._fixed is not None:
            return self._fixed
        if time.monotonic() - self._stores_at > STORES_REFRESH_S:
            own = ray.get_runtime_context().get_node_id()
            alive = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
            # Own node first: it wins ties, and its blocks travel no network.
            alive.sort(key=lambda n: n != own)
            self._stores = [(store_name(n), node_store(n, self.capacity_bytes)) for n in alive]
            self._stores_at = time.monotonic()
        return self._stores

    def lookup(self, hashes: list[int]) -> tuple[int, str | None, str | None]:
        stores = self.stores() if hashes else []
        if not stores:
            return 0, None, None
        lease = uuid.uuid4().hex
        refs = [handle.lookup.remote(self.layout, list(hashes), lease) for _, handle in stores]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s)
        ready = set(ready)
        counts = []
        for (name, _), ref in zip(stores, refs):
            count = 0
            if ref in ready:
                try:
                    count = int(ray.get(ref))
                except ray.exceptions.RayError:
                    self._forget(name)  # dead: counts as 0, and the next refresh looks again
            counts.append(count)
        best = max(range(len(stores)), key=lambda i: (counts[i], -i))
        # A slow store may still pin under this lease: release it there too.  The store runs calls
        # on several threads, so the release may run first; it remembers the lease and pins nothing.
        for i, (name, handle) in enumerate(stores):
            if i != best or counts[i] == 0:
                handle.release.remote(lease)
        if counts[best] == 0:
            return 0, None, None
        return counts[best], stores[best][0], lease

    def release(self, store_name: str, lease: str) -> None:
        handle = dict(self.stores()).get(store_name)
        if handle is None:
            try:
                handle = get_store(store_name)
            except ValueError:
                return  # the store is gone, and its pins with it
        handle.release.remote(lease)

    def _forget(self, name: str) -> None:
        forget_store(name)
        self._stores_at = -float("inf")
