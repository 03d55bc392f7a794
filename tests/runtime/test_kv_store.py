"""The shared KV-block store (issue 26): bytes, capacity, leases, ownership, and finding stores."""

import time
import types
import uuid

import numpy as np
import pytest
import ray

from ray_attn.runtime import kv_store
from ray_attn.runtime.kv_store import (
    KVBlockStore, SharedKVClient, forget_store, get_store, node_store, store_name,
)
from tests.timescale import scaled, wait_for

BIG = 2**64 - 1  # chain hashes are unsigned 64-bit: the top of the range must survive the trip


@pytest.fixture
def actors(ray_local):
    """Actors a test creates; every one is killed at the end, detached ones included."""
    made = []
    yield made
    for a in made:
        ray.kill(a)


def new_store(actors, capacity_bytes=1 << 20, **kw):
    name = f"test_kv_store:{uuid.uuid4().hex}"
    store = KVBlockStore.options(name=name, namespace=kv_store.STORE_NAMESPACE).remote(
        capacity_bytes, **kw)
    actors.append(store)
    return name, store


def blocks(rng, n, block_bytes):
    return rng.integers(0, 256, size=(n, block_bytes), dtype=np.uint8)


def test_round_trip_tp2_out_of_order_and_layouts(actors):
    _, store = new_store(actors)
    rng = np.random.default_rng(0)
    hashes = [BIG, 7, 2**63 + 5]
    shard = [blocks(rng, 3, 1000), blocks(rng, 3, 1000)]

    # Rank 1 first, rows out of order; rank 0 in one call; rank 1's missing row last.
    assert ray.get(store.put.remote("A", 1, 2, [hashes[2], hashes[0]], shard[1][[2, 0]])) == 2
    assert ray.get(store.lookup.remote("A", hashes, "l0")) == 0  # no entry complete yet
    assert ray.get(store.put.remote("A", 0, 2, hashes, shard[0])) == 3
    # hashes[1] has rank 0 only: the count stops at that gap although hashes[2] is complete.
    assert ray.get(store.lookup.remote("A", hashes, "l1")) == 1
    with pytest.raises(KeyError, match=f"hash={hashes[1]}, rank=1"):
        ray.get(store.get.remote("A", 1, hashes))
    assert ray.get(store.put.remote("A", 1, 2, [hashes[1]], shard[1][[1]])) == 1
    assert ray.get(store.lookup.remote("A", hashes, "l2")) == 3
    for rank in (0, 1):
        got = np.stack(ray.get(ray.get(store.get.remote("A", rank, hashes))))
        assert got.dtype == np.uint8 and got.tobytes() == shard[rank].tobytes()

    # Re-putting a held shard stores nothing new and changes no byte.
    before = ray.get(store.stats.remote())
    assert ray.get(store.put.remote("A", 0, 2, hashes[:1], blocks(rng, 1, 1000))) == 1
    after = ray.get(store.stats.remote())
    assert after["bytes"] == before["bytes"] == 6000 and after["puts"] == before["puts"]
    assert rows_bytes(store, "A", 0, hashes) == shard[0].tobytes()

    # Another layout sees none of A's blocks, and its own blocks under the same hashes stay apart.
    assert ray.get(store.lookup.remote("B", hashes, "l3")) == 0
    with pytest.raises(KeyError, match="'B'"):
        ray.get(store.get.remote("B", 0, hashes))
    other = blocks(rng, 3, 1000)
    assert ray.get(store.put.remote("B", 0, 1, hashes, other)) == 3
    assert rows_bytes(store, "B", 0, hashes) == other.tobytes()
    assert rows_bytes(store, "A", 0, hashes) == shard[0].tobytes()
    stats = ray.get(store.stats.remote())
    assert stats["entries"] == 6 and stats["complete"] == 6 and stats["hits"] == 15
    assert stats["leases"] == 2  # l1 and l2: l0 and l3 counted 0 and pin nothing
    assert ray.get(store.clear.remote("B")) == 3
    assert ray.get(store.stats.remote())["entries"] == 3


def test_capacity_lru_pins_and_drops(actors):
    _, store = new_store(actors, capacity_bytes=300)  # three blocks of 100 bytes
    rng = np.random.default_rng(1)
    data = {h: blocks(rng, 1, 100) for h in range(1, 7)}

    def put(*hs):
        return ray.get(store.put.remote("L", 0, 1, list(hs), np.concatenate([data[h] for h in hs])))

    def held():
        return {k for k in data if _holds(store, k)}

    for h in (1, 2, 3):
        assert put(h) == 1  # LRU order 1, 2, 3
    assert ray.get(store.lookup.remote("L", [1], "A")) == 1  # pins 1 (and touches it)
    ray.get(store.get.remote("L", 0, [2]))
    ray.get(store.get.remote("L", 0, [3]))  # LRU order 1 (pinned), 2, 3
    assert put(4) == 1
    # Unpinned, 1 would have gone first; pinned, the oldest unpinned one goes instead.
    assert held() == {1, 3, 4}
    assert ray.get(store.stats.remote())["evicted"] == 1

    # Everything pinned: a put that cannot fit stores nothing, and neither raises nor waits.
    assert ray.get(store.lookup.remote("L", [1, 3, 4], "B")) == 3
    assert put(5) == 0
    assert put(5, 6) == 0
    stats = ray.get(store.stats.remote())
    assert stats["dropped"] == 3 and stats["bytes"] == 300 and held() == {1, 3, 4}

    # Releasing unpins: A's pin on 1 is one of two, B's release frees all three.
    ray.get(store.release.remote("A"))
    assert put(5) == 0
    ray.get(store.release.remote("B"))
    assert ray.get(store.stats.remote())["pinned"] == 0
    assert put(5) == 1

    # A block larger than the whole store is dropped, not raised on.
    assert ray.get(store.put.remote("L", 0, 1, [9], blocks(rng, 1, 301))) == 0

    # In one put past capacity the leading rows win: a lookup could not use the tail without them.
    ray.get(store.clear.remote())
    assert put(1, 2, 3, 4, 5) == 3
    assert held() == {1, 2, 3}
    assert rows_bytes(store, "L", 0, [1, 2, 3]) == b"".join(
        data[h].tobytes() for h in (1, 2, 3))


def rows_bytes(store, layout, rank, hashes) -> bytes:
    """The store's rows of ``hashes`` for ``rank``, as one byte string."""
    refs = ray.get(store.get.remote(layout, rank, hashes))
    assert all(isinstance(r, ray.ObjectRef) for r in refs)  # the bytes never pass through the store again
    return b"".join(r.tobytes() for r in ray.get(refs))


def test_lru_evicts_a_chain_from_its_tail(actors):
    _, store = new_store(actors, capacity_bytes=400)
    rng = np.random.default_rng(2)
    assert ray.get(store.put.remote("L", 0, 1, [1, 2, 3, 4], blocks(rng, 4, 100))) == 4
    assert ray.get(store.put.remote("L", 0, 1, [5], blocks(rng, 1, 100))) == 1
    # Evicting the head would leave 2..4 unreachable; the tail goes, the chain still serves 3.
    assert ray.get(store.lookup.remote("L", [1, 2, 3, 4], "x")) == 3


def test_expired_lease_is_swept(actors):
    _, store = new_store(actors, capacity_bytes=300, lease_ttl_s=0.3)
    rng = np.random.default_rng(3)
    assert ray.get(store.put.remote("L", 0, 1, [1, 2, 3], blocks(rng, 3, 100))) == 3
    assert ray.get(store.lookup.remote("L", [1, 2, 3], "gone")) == 3
    time.sleep(0.5)  # a replica that never released: its pins lapse
    assert ray.get(store.put.remote("L", 0, 1, [4], blocks(rng, 1, 100))) == 1
    stats = ray.get(store.stats.remote())
    assert stats["leases"] == 0 and stats["evicted"] == 1


def _holds(store, h, layout="L"):
    lease = uuid.uuid4().hex
    n = ray.get(store.lookup.remote(layout, [h], lease))
    ray.get(store.release.remote(lease))
    return n == 1


@ray.remote(num_cpus=0)
class Publisher:
    """A replica's rank: the block bytes it publishes are an object it owns."""

    def publish(self, store, hashes, seed, block_bytes):
        data = np.random.default_rng(seed).integers(0, 256, (len(hashes), block_bytes), np.uint8)
        return ray.get(store.put.remote("L", 0, 1, hashes, data))

    def ping(self):
        return True


def kill_and_wait(actor, probe: str = "stats") -> None:
    """``ray.kill``, then wait until calls (``probe``) fail: it returns before the actor is gone,
    and a call sent at once may still be answered -- a lookup by the store it meant to lose (seen
    on a loaded box)."""
    ray.kill(actor)
    deadline = time.monotonic() + scaled(60)
    while True:
        try:
            ray.get(getattr(actor, probe).remote(), timeout=scaled(10))
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            pass  # a busy box: ask again
        assert time.monotonic() < deadline, f"{actor} did not die"
        time.sleep(0.1)


def test_blocks_outlive_the_replica_that_published_them(actors):
    _, store = new_store(actors)
    pub = Publisher.remote()
    hashes = list(range(100, 108))
    # 8 x 64 KiB: far over the inline limit, so the argument is an object-store object of pub's.
    assert ray.get(pub.publish.remote(store, hashes, 4, 65536)) == 8
    kill_and_wait(pub, "ping")
    expected = np.random.default_rng(4).integers(0, 256, (8, 65536), np.uint8)
    assert ray.get(store.lookup.remote("L", hashes, "r")) == 8
    assert rows_bytes(store, "L", 0, hashes) == expected.tobytes()
    # Reading back cannot tell a copy from a view of pub's (dead) object, as the view alone keeps
    # its buffer mapped: the store must hold its own copy of every shard.
    assert ray.get(store.stats.remote())["borrowed"] == 0


def test_client_picks_the_longest_run_and_survives_dead_stores(actors):
    rng = np.random.default_rng(5)
    chain = [11, 12, 13, 14]
    short_name, short = new_store(actors)
    long_name, long = new_store(actors)
    ray.get(short.put.remote("L", 0, 1, chain[:2], blocks(rng, 2, 64)))
    ray.get(long.put.remote("L", 0, 1, chain, blocks(rng, 4, 64)))
    ray.get(long.put.remote("other", 0, 1, chain, blocks(rng, 4, 64)))
    # Every store here answers: a deadline for the answers is only a wait, stretched on a busy box
    # (with the library's 3 s, a store that answered late counted as holding nothing: loaded run, 12-02)
    client = SharedKVClient("L", tp=1, stores=[(short_name, short), (long_name, long)], timeout_s=scaled(30))

    count, name, lease = client.lookup(chain)
    assert (count, name) == (4, long_name) and lease
    # The loser's lease goes (its release is sent, not awaited, and the store runs calls on several
    # threads, so a stats call may run first: wait); the winner's holds until the replica releases it.
    assert wait_for(lambda: ray.get(short.stats.remote())["leases"] == 0, 30)
    assert ray.get(long.stats.remote())["leases"] == 1
    client.release(name, lease)
    assert wait_for(lambda: ray.get(long.stats.remote())["leases"] == 0, 30)

    assert client.lookup([99] + chain) == (0, None, None)
    assert SharedKVClient("nobody", tp=1, stores=[(long_name, long)], timeout_s=scaled(30)).lookup(chain) == (0, None, None)

    kill_and_wait(long)
    count, name, lease = client.lookup(chain)
    assert (count, name) == (2, short_name)
    client.release(name, lease)
    kill_and_wait(short)
    assert client.lookup(chain) == (0, None, None)



@ray.remote(num_cpus=0)
class SlowStore:
    def lookup(self, layout, hashes, lease):
        time.sleep(60)
        return len(hashes)

    def release(self, lease):
        pass


def test_client_does_not_wait_for_a_slow_store(actors):
    name, store = new_store(actors)
    ray.get(store.put.remote("L", 0, 1, [1, 2], blocks(np.random.default_rng(6), 2, 64)))
    slow = SlowStore.remote()
    actors.append(slow)
    # the live store's answer (one call to a running actor, milliseconds) must make it; the slow one
    # sleeps 60 s, and the test waits the whole timeout for it (11.6 s at scaled(5) on a slow 2-core VM)
    timeout = min(scaled(2), 30.0)
    client = SharedKVClient("L", tp=1, stores=[("slow", slow), (name, store)], timeout_s=timeout)
    t0 = time.monotonic()
    count, got, _ = client.lookup([1, 2])
    assert (count, got) == (2, name)
    assert time.monotonic() - t0 < timeout + scaled(5)


def registered(name: str) -> bool:
    try:
        ray.get_actor(name, namespace=kv_store.STORE_NAMESPACE)
    except ValueError:
        return False
    return True


def _kill_named_store(name: str) -> None:
    """Kill this node's store if a test before made one (our own local Ray: detached actors live
    as long as it), and wait until its name is free."""
    forget_store(name)
    try:
        old = ray.get_actor(name, namespace=kv_store.STORE_NAMESPACE)
    except ValueError:
        return
    ray.kill(old)
    assert wait_for(lambda: not registered(name), 30), f"store {name} still registered after ray.kill"


def test_node_store_is_one_detached_named_actor_per_node(actors):
    node = ray.get_runtime_context().get_node_id()
    name = store_name(node)
    _kill_named_store(name)  # one an earlier test in this Ray made, with another capacity
    try:
        a = node_store(capacity_bytes=1 << 20)
        actors.append(a)
        forget_store(name)  # the second call finds the actor by name, not in this module's cache
        b = node_store(node)
        assert a._actor_id == b._actor_id == get_store(name)._actor_id
        assert ray.get(b.stats.remote())["capacity_bytes"] == 1 << 20
        info = ray._private.state.actors(actor_id=a._actor_id.hex())
        assert info["IsDetached"] and info["Name"] == name
        assert info["Address"]["NodeID"] == node

        client = SharedKVClient("L", tp=1, timeout_s=scaled(30))
        assert [n for n, _ in client.stores()] == [name]
        ray.get(a.put.remote("L", 0, 1, [5], np.zeros((1, 8), np.uint8)))
        count, got, lease = client.lookup([5])
        assert (count, got) == (1, name)
        client.release(got, lease)
    finally:
        forget_store(name)


# -- the store's rules in this process (BlockStore: the actor's class before ray.remote) -------------
def test_lookups_and_gets_go_on_while_a_put_copies(ray_local, monkeypatch):
    """A put's copies run outside the lock: a lookup issued while they are under way is answered
    at once, counting the rows held before and none of those being copied; they count once copied.
    The order of events is forced (the copy waits for the lookup), not timed."""
    import threading

    store = kv_store.BlockStore(1 << 20)
    rng = np.random.default_rng(6)
    assert store.put("L", 0, 1, [1], blocks(rng, 1, 100)) == 1
    copying, go = threading.Event(), threading.Event()
    real_put = ray.put

    def slow_put(value, **kw):
        copying.set()
        assert go.wait(timeout=scaled(60))
        return real_put(value, **kw)

    monkeypatch.setattr(kv_store.ray, "put", slow_put)
    done = []
    t = threading.Thread(target=lambda: done.append(store.put("L", 0, 1, [2, 3], blocks(rng, 2, 100))))
    t.start()
    assert copying.wait(timeout=scaled(60))
    assert store.lookup("L", [1, 2, 3], "during") == 1  # answered while the put copies
    assert store.stats()["copying"] == 2 and not done
    # the same rows put again meanwhile are counted as on their way, not copied twice
    monkeypatch.setattr(kv_store.ray, "put", real_put)
    assert store.put("L", 0, 1, [2], blocks(rng, 1, 100)) == 1 and store.stats()["bytes"] == 300
    go.set()
    t.join(timeout=scaled(60))
    assert done == [2]
    assert store.lookup("L", [1, 2, 3], "after") == 3
    assert store.stats()["copying"] == 0 and store.stats()["bytes"] == 300


def test_a_release_that_runs_before_its_lookup_leaves_nothing_pinned(ray_local, monkeypatch):
    """The client releases a slow store's lease without waiting for its lookup; the store's threads
    may run that release first.  The late lookup still answers, but pins nothing (else the rows
    stay pinned, unevictable, for a whole TTL)."""
    store = kv_store.BlockStore(1 << 20, lease_ttl_s=120)
    rng = np.random.default_rng(8)
    assert store.put("L", 0, 1, [1, 2], blocks(rng, 2, 100)) == 2
    store.release("late")
    assert store.lookup("L", [1, 2], "late") == 2
    assert store.stats()["leases"] == 0 and store.stats()["pinned"] == 0
    # another lease pins as before, and its release unpins (and is not remembered: it pinned here)
    assert store.lookup("L", [1, 2], "fresh") == 2 and store.stats()["pinned"] == 2
    store.release("fresh")
    st = store.stats()
    assert (st["leases"], st["pinned"], st["released_leases"]) == (0, 0, 1)
    # a released lease is remembered one TTL, no longer (the clock moved on, not waited for)
    now = time.monotonic()
    monkeypatch.setattr(kv_store, "time", types.SimpleNamespace(monotonic=lambda: now + 121))
    assert store.stats()["released_leases"] == 0


def test_object_store_pressure_drops_rows_instead_of_raising(ray_local, monkeypatch):
    """A full object store (ObjectStoreFullError on the store's own put) drops that row and the
    ones after it -- a lookup stops at the gap anyway -- and returns their bytes to the budget."""
    store = kv_store.BlockStore(1 << 20)
    rng = np.random.default_rng(7)
    real_put, calls = ray.put, []

    def full_after_one(value, **kw):
        calls.append(1)
        if len(calls) > 1:
            raise ray.exceptions.ObjectStoreFullError("full")
        return real_put(value, **kw)

    monkeypatch.setattr(kv_store.ray, "put", full_after_one)
    assert store.put("L", 0, 1, [1, 2, 3], blocks(rng, 3, 100)) == 1
    stats = store.stats()
    assert stats["bytes"] == 100 and stats["dropped"] == 2 and stats["copying"] == 0
    assert store.lookup("L", [1, 2, 3], "x") == 1
