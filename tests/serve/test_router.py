"""The prefix-aware router's parts without a cluster: the per-replica block table, the prompt hashes
the front deployment attaches, the routing decision over fake replicas, and the ASGI relay."""

from __future__ import annotations

import asyncio
import itertools
import json
import zlib

import numpy as np
import pytest
from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
)
from ray.serve.request_router import PendingRequest

from ray_attn.planner.block_pool import prompt_hashes
from ray_attn.serve.ingress import RoutedHTTPRequest, prefix_block_hashes, run_asgi
from ray_attn.serve.router import PrefixAwareRequestRouter, PrefixIndex, request_block_hashes

BS = 16


@pytest.fixture
def nprng(request):
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


# ------------------------------------------------------------------------------- the block table
class ReferenceIndex:
    """The same table written plainly: a list per replica, most recent last."""

    def __init__(self, cap):
        self.cap, self.lists = cap, {}

    def record(self, r, hashes):
        lst = self.lists.setdefault(r, [])
        for h in reversed(hashes):
            if h in lst:
                lst.remove(h)
            lst.append(h)
        del lst[:max(0, len(lst) - self.cap)]

    def match(self, r, hashes):
        lst, n = self.lists.get(r, []), 0
        while n < len(hashes) and hashes[n] in lst:
            n += 1
        return n


@pytest.mark.parametrize("cap", [1, 3, 8, 64])
@pytest.mark.parametrize("num_prefixes", [1, 4])
def test_index_matches_a_plain_reference(nprng, cap, num_prefixes):
    """Random prompts built from a few shared prefixes, recorded on 3 replicas in random order:
    every match answer equals the reference's, and no replica holds more than ``cap`` hashes."""
    index, ref = PrefixIndex(cap), ReferenceIndex(cap)
    prefixes = [nprng.integers(0, 512, BS * int(nprng.integers(1, 5))).tolist() for _ in range(num_prefixes)]
    for step in range(60):
        p = prefixes[int(nprng.integers(num_prefixes))] + nprng.integers(0, 512, int(nprng.integers(0, 40))).tolist()
        hashes = [int(h) for h in prompt_hashes(p, len(p) // BS, BS)]
        r = int(nprng.integers(3))
        for q in range(3):
            assert index.match(q, hashes) == ref.match(q, hashes), (step, q)
        index.record(r, hashes)
        ref.record(r, hashes)
        assert index.num_blocks(r) == len(ref.lists[r]) <= cap


def test_eviction_drops_a_prompts_tail_before_its_head():
    index = PrefixIndex(3)
    index.record("a", [1, 2, 3])
    index.record("a", [9])  # one over the cap: block 3 (the tail) goes, not block 1
    assert index.match("a", [1, 2, 3]) == 2
    assert index.match("a", [9]) == 1


def test_match_stops_at_the_first_missing_block():
    index = PrefixIndex(16)
    index.record("a", [1, 2, 3, 4])
    assert index.match("a", [1, 2, 7, 4]) == 2
    assert index.match("a", [5, 1, 2]) == 0
    assert index.match("b", [1]) == 0


def test_keep_only_and_drop_forget_replicas():
    index = PrefixIndex(16)
    for r in "abc":
        index.record(r, [1, 2])
    index.keep_only(["a", "b"])
    index.drop("a")
    assert [index.match(r, [1, 2]) for r in "abc"] == [0, 2, 0]


def test_index_size_is_validated():
    with pytest.raises(ValueError, match="max_blocks_per_replica"):
        PrefixIndex(0)


# ------------------------------------------------------------------------------- prompt hashing
@pytest.mark.parametrize("shared_blocks", [0, 1, 3])
@pytest.mark.parametrize("tail", [0, 5, 16])
def test_token_prompt_hashes_are_the_planners_and_shared_prefixes_share_them(nprng, shared_blocks, tail):
    shared = nprng.integers(0, 512, shared_blocks * BS).tolist()
    a = shared + nprng.integers(0, 512, BS + tail).tolist()
    b = shared + nprng.integers(0, 512, BS + tail).tolist()
    ha = prefix_block_hashes(json.dumps({"prompt_token_ids": a, "max_tokens": 3}).encode(), BS)
    hb = prefix_block_hashes(json.dumps({"prompt": b}).encode(), BS)  # OpenAI-style token prompt
    assert list(ha) == [int(h) for h in prompt_hashes(a, len(a) // BS, BS)]
    assert len(ha) == len(a) // BS
    common = next((i for i, (x, y) in enumerate(zip(ha, hb)) if x != y), len(ha))
    assert common == shared_blocks


def test_text_and_chat_prompts_hash_by_byte_chunks():
    text = "You are a helpful assistant. " * 20
    one = prefix_block_hashes(json.dumps({"prompt": text + "first"}).encode(), BS)
    two = prefix_block_hashes(json.dumps({"prompt": text + "second question"}).encode(), BS)
    assert len(one) == len((text + "first").encode()) // (4 * BS)
    assert one[:len(text) // (4 * BS)] == two[:len(text) // (4 * BS)]
    chat = lambda q: {"messages": [{"role": "system", "content": text},  # noqa: E731
                                   {"role": "user", "content": [{"type": "text", "text": q}]}]}
    c1 = prefix_block_hashes(json.dumps(chat("a")).encode(), BS)
    c2 = prefix_block_hashes(json.dumps(chat("b")).encode(), BS)
    assert len(c1) >= 9 and c1[:9] == c2[:9]
    tokens = prefix_block_hashes(json.dumps({"prompt_token_ids": list(range(64))}).encode(), BS)
    assert not set(tokens) & set(one)


@pytest.mark.parametrize("body", [b"", b"[1, 2]", b'{"prompt_token_ids": [1, 2', b'{"max_tokens": 3}',
                                  b'{"prompt_token_ids": [true, 2]}', b'{"prompt_token_ids": [-1]}',
                                  b'{"messages": [{"role": "user", "content": 5}]}', b"\xff\xfe"])
def test_bodies_without_a_usable_prompt_route_by_load(body):
    assert prefix_block_hashes(body, BS) == ()


# ----------------------------------------------------------------------- the routing decision
DEP = DeploymentID(name="LLMServer", app_name="test")


class FakeReplica:
    def __init__(self, name: str, queue_len: int = 0):
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEP)
        self.max_ongoing_requests, self.node_id, self.availability_zone = 100, "node", None
        self.multiplexed_model_ids = set()
        self.queue_len = queue_len

    async def get_queue_len(self, deadline_s: float) -> int:
        return self.queue_len


_ids = itertools.count()


def pending(hashes=()) -> PendingRequest:
    n = next(_ids)
    args = [RoutedHTTPRequest({}, b"", tuple(hashes))]
    return PendingRequest(args=args, kwargs={},
                          metadata=RequestMetadata(request_id=f"r{n}", internal_request_id=f"i{n}"))


def make_router(replicas, **kw) -> PrefixAwareRequestRouter:
    router = PrefixAwareRequestRouter(deployment_id=DEP, handle_source=DeploymentHandleSource.UNKNOWN,
                                      use_replica_queue_len_cache=True)
    router.initialize_state(**kw)
    router.update_replicas(replicas)
    return router


def ids(ranks):
    return [sorted(r.replica_id.unique_id for r in rank) for rank in ranks]


def test_request_without_hashes_gets_power_of_two_choices():
    async def go():
        reps = [FakeReplica(x) for x in "abc"]
        router = make_router(reps)
        ranks = await router.choose_replicas(reps, pending())
        assert len(ranks) == 1 and len(ranks[0]) == 2 and len(set(ids(ranks)[0])) == 2
    asyncio.run(asyncio.wait_for(go(), 30))


@pytest.mark.parametrize("holder", ["a", "b", "c"])
def test_prefix_goes_to_the_replica_holding_the_longest_run(holder):
    async def go():
        reps = [FakeReplica(x) for x in "abc"]
        router = make_router(reps)
        hashes = list(range(100, 106))
        other = [r for r in reps if r.replica_id.unique_id != holder]
        # A competitor holds the first 3 blocks, the holder all 6.
        router.on_request_routed(pending(hashes[:3]), other[0].replica_id, None)
        router.on_request_routed(pending(hashes), next(r for r in reps if r.replica_id.unique_id == holder).replica_id, None)
        ranks = await router.choose_replicas(reps, pending(hashes + [999]))
        assert ids(ranks)[0] == [holder]
        assert len(ranks) == 2 and len(ranks[1]) == 2  # the fallback rank if the holder is full
        assert router.decisions["prefix"] == 1
    asyncio.run(asyncio.wait_for(go(), 30))


@pytest.mark.parametrize("lead,threshold,affine", [(0, 0, True), (3, 3, True), (4, 3, False),
                                                   (9, 8, False), (8, 8, True)])
def test_a_holder_too_far_ahead_in_queue_loses_the_request(lead, threshold, affine):
    async def go():
        reps = [FakeReplica("a", queue_len=2 + lead), FakeReplica("b", queue_len=2)]
        router = make_router(reps, imbalanced_threshold=threshold)
        router.on_request_routed(pending([1, 2]), reps[0].replica_id, None)
        ranks = await router.choose_replicas(reps, pending([1, 2, 3]))
        if affine:
            assert ids(ranks)[0] == ["a"] and router.decisions["prefix"] == 1
        else:
            assert ids(ranks) == [["a", "b"]] and router.decisions["imbalanced"] == 1
    asyncio.run(asyncio.wait_for(go(), 30))


def test_a_burst_counts_its_own_requests_against_the_holder():
    """Decisions made before any replica answers (a burst) see the holder's length grow by the
    requests already sent to it: with threshold 3 the holder takes 4 (leads 0-3), then the rest
    go by load.  Read from Serve's stale cache alone, all 8 went to the holder."""
    async def go():
        reps = [FakeReplica("a"), FakeReplica("b")]
        router = make_router(reps, imbalanced_threshold=3)
        router.on_request_routed(pending([1, 2]), reps[0].replica_id, None)
        firsts = [ids(await router.choose_replicas(reps, pending([1, 2, 3])))[0] for _ in range(8)]
        assert firsts[:4] == [["a"]] * 4 and all(f == ["a", "b"] for f in firsts[4:]), firsts
        assert router.decisions["prefix"] == 4 and router.decisions["imbalanced"] == 4
    asyncio.run(asyncio.wait_for(go(), 30))


def test_min_match_blocks_and_forgotten_replicas():
    async def go():
        reps = [FakeReplica("a"), FakeReplica("b")]
        router = make_router(reps, min_match_blocks=2)
        router.on_request_routed(pending([1]), reps[0].replica_id, None)
        assert len((await router.choose_replicas(reps, pending([1, 2])))) == 1  # 1 block < 2
        router.on_request_routed(pending([1, 2]), reps[0].replica_id, None)
        assert ids(await router.choose_replicas(reps, pending([1, 2])))[0] == ["a"]
        router.update_replicas([reps[1]])  # replica a went away: its blocks are forgotten
        router.update_replicas(reps)
        assert len(await router.choose_replicas(reps, pending([1, 2]))) == 1
        assert router.decisions == {"prefix": 1, "imbalanced": 0, "no_match": 2, "shared": 0}
    asyncio.run(asyncio.wait_for(go(), 30))


@pytest.mark.parametrize("shared_tier", [False, True])
def test_shared_tier_blocks_count_for_every_replica(shared_tier):
    """With a shared KV tier, the prefix a lost replica computed is still fetchable by all: the
    request goes by load as a 'shared' decision; a live holder of the longest run still wins."""
    async def go():
        reps = [FakeReplica("a"), FakeReplica("b"), FakeReplica("c")]
        router = make_router(reps, shared_tier=shared_tier)
        router.on_request_routed(pending([1, 2, 3]), reps[0].replica_id, None)
        assert ids(await router.choose_replicas(reps, pending([1, 2, 3, 4])))[0] == ["a"]
        router.update_replicas(reps[1:])  # a is gone; with sharing, its blocks are not
        ranks = await router.choose_replicas(reps[1:], pending([1, 2, 3, 4]))
        assert ids(ranks) == [["b", "c"]]
        want = {"prefix": 1, "imbalanced": 0, "no_match": 0, "shared": 0}
        want["shared" if shared_tier else "no_match"] += 1
        assert router.decisions == want
    asyncio.run(asyncio.wait_for(go(), 30))


@pytest.mark.parametrize("kw,field", [({"imbalanced_threshold": -1}, "imbalanced_threshold"),
                                      ({"min_match_blocks": 0}, "min_match_blocks"),
                                      ({"max_blocks_per_replica": 0}, "max_blocks_per_replica")])
def test_router_settings_are_validated(kw, field):
    with pytest.raises(ValueError, match=field):
        make_router([], **kw)


def test_hashes_are_read_from_args_or_kwargs():
    async def go():  # a PendingRequest makes its future on the running loop
        pr = PendingRequest(args=[], kwargs={"request": RoutedHTTPRequest({}, b"", (5, 6))},
                            metadata=RequestMetadata(request_id="x", internal_request_id="y"))
        return request_block_hashes(pr)

    assert request_block_hashes(None) == ()
    assert asyncio.run(go()) == (5, 6)


# ------------------------------------------------------------------------------ the ASGI relay
def test_run_asgi_relays_messages_and_cancels_the_app_when_the_consumer_stops():
    state = {"body": None, "cancelled": False}

    async def app(scope, receive, send):
        state["body"] = (await receive())["body"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        try:
            for i in range(1000):
                await send({"type": "http.response.body", "body": b"%d" % i, "more_body": True})
                await asyncio.sleep(0.001)
        except asyncio.CancelledError:
            state["cancelled"] = True
            raise

    async def go():
        gen = run_asgi(app, {"type": "http"}, b"payload")
        got = [await gen.__anext__() for _ in range(3)]
        await gen.aclose()
        await asyncio.sleep(0.05)
        # Checked while the loop runs: asyncio.run cancels leftover tasks when it ends.
        return got, state["cancelled"]

    got, cancelled = asyncio.run(asyncio.wait_for(go(), 30))
    assert state["body"] == b"payload"
    assert [m["type"] for m in got] == ["http.response.start", "http.response.body", "http.response.body"]
    assert cancelled, "closing the relay must cancel the app (the handler aborts the request)"


def test_run_asgi_reraises_a_failure_before_the_response_is_complete():
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError("boom")

    async def go():
        return [m async for m in run_asgi(app, {"type": "http"}, b"")]

    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(asyncio.wait_for(go(), 30))
