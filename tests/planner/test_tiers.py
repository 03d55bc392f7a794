"""The planner's KV tiers (ray_attn/planner/tiers.py) against a simulated rank.

``FakeRank`` holds, for each device block, host slot and store entry, *what content it holds*:
the chain hash of the prefix a full block ends (or a marker for a partial one).  It applies each
plan's ``KVTransfers`` in the ranks' order and then "runs the forward": every block a row writes
this step gets that row's content.  After every step, every full block in every running row's
block table must hold its prefix's hash -- so a tier hit copied from the wrong slot, an offload
read after the forward overwrote its block, a publish of a block not yet computed, or a host
slot overwritten while it was being read all fail here, on random workloads.
"""

from __future__ import annotations

import random

import pytest

from ray_attn.planner import Planner, ScheduledRequest
from ray_attn.planner.block_pool import prompt_hashes
from ray_attn.planner.tiers import SHARED, HostTier, KVTiers

BS = 4


class FakeStore:
    """The shared stores as the planner sees them (SharedKVClient's lookup/release)."""

    def __init__(self):
        self.blocks: dict[int, object] = {}
        self.leases: set[str] = set()
        self.n = 0

    def lookup(self, hashes):
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        if not n:
            return 0, None, None
        self.n += 1
        lease = f"lease{self.n}"
        self.leases.add(lease)
        return n, "store0", lease

    def release(self, store, lease):
        assert store == "store0"
        self.leases.discard(lease)


class FakeRank:
    def __init__(self, num_blocks, host_slots, store: FakeStore | None):
        self.dev = [None] * num_blocks
        self.host = [None] * host_slots
        self.store = store

    def apply(self, t):
        if t is None:
            return
        out = [self.dev[b] for b in t.offload_blocks]
        pub = [self.dev[b] for b in t.publish_blocks]
        for s, c in zip(t.offload_slots, out):
            assert c is not None and not isinstance(c, tuple), "offloaded a block with no full content"
            self.host[s] = c
        for h, c in zip(t.publish_hashes, pub):
            assert c == h, "published a block that does not hold its hash's content"
            self.store.blocks[h] = c
        for s, b in zip(t.onload_slots, t.onload_blocks):
            self.dev[b] = self.host[s]
        for h, b, name in zip(t.fetch_hashes, t.fetch_blocks, t.fetch_stores):
            assert name == "store0"
            self.dev[b] = self.store.blocks[h]

    def forward(self, plan, tokens_of):
        a = plan.attn
        for r, rid in enumerate(plan.req_ids):
            toks = tokens_of[rid]
            seq = int(a.seq_lens[r])
            first = int(plan.num_computed_tokens[r]) // BS
            for col in range(first, -(-seq // BS)):
                b = int(a.block_table[r, col])
                if (col + 1) * BS <= seq:
                    self.dev[b] = int(prompt_hashes(toks, col + 1, BS)[-1])
                else:
                    self.dev[b] = ("partial", tuple(toks[:seq]))

    def check(self, plan, tokens_of):
        a = plan.attn
        for r, rid in enumerate(plan.req_ids):
            toks = tokens_of[rid]
            full = int(a.seq_lens[r]) // BS
            want = prompt_hashes(toks, full, BS).tolist()
            got = [self.dev[int(a.block_table[r, c])] for c in range(full)]
            assert got == want, f"request {rid}: block contents {got} != {want}"


def run_workload(seed, host_slots, shared, num_blocks=24, steps=120):
    rng = random.Random(seed)
    store = FakeStore() if shared else None
    tiers = KVTiers(host_slots=host_slots, shared=store, layout="L", min_shared_tokens=BS, block_size=BS)
    planner = Planner(num_blocks=num_blocks, block_size=BS, num_query_heads=2, num_kv_heads=1,
                      enable_cascade=False, tiers=tiers)
    rank = FakeRank(num_blocks, host_slots, store)
    docs = [[rng.randrange(50) for _ in range(BS * rng.randint(2, 5))] for _ in range(4)]
    running: dict[str, list] = {}
    budget: dict[str, int] = {}
    n = 0
    for _ in range(steps):
        sched = [ScheduledRequest(rid, toks, 1) for rid, toks in running.items()]
        if len(running) < 3 and rng.random() < 0.6:
            n += 1
            rid = f"r{n}"
            toks = list(rng.choice(docs)) + [rng.randrange(50) for _ in range(rng.randint(1, 6))]
            sched.append(ScheduledRequest(rid, toks, None))
            running[rid] = toks
            budget[rid] = rng.randint(1, 6)
        if not sched:
            continue
        try:
            plan = planner.plan(sched)
        except Exception:  # out of blocks: drop the newest and go on
            rid = sched[-1].req_id
            if planner.has_request(rid):
                planner.free(rid)
            running.pop(rid)
            continue
        rank.apply(plan.kv_transfers)
        rank.forward(plan, running)
        rank.check(plan, running)
        for rid in plan.req_ids:
            toks = running[rid]
            if planner.num_computed_tokens(rid) == len(toks):
                budget[rid] -= 1
                if budget[rid] < 0:
                    planner.free(rid)
                    del running[rid]
                else:
                    toks.append(rng.randrange(50))
        planner.pool.check_invariants()
        if tiers.host is not None:
            tiers.host.check_invariants()
    return tiers.stats, store


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("host_slots,shared", [(8, False), (40, False), (0, True), (6, True)])
def test_every_block_holds_its_prefix_with_tiers(seed, host_slots, shared):
    stats, store = run_workload(seed, host_slots, shared)
    if host_slots:
        assert stats.offloaded_blocks > 0
    if shared:
        assert stats.published_blocks > 0


def test_tiers_are_hit_on_a_repeating_workload():
    """Across seeds, the workload (4 documents, a 24-block pool) hits both lower tiers: the
    checks above are not vacuous."""
    host = sum(run_workload(s, 40, False)[0].onloaded_blocks for s in range(6))
    shared = sum(run_workload(s, 0, True)[0].fetched_blocks for s in range(6))
    assert host > 20 and shared > 20


def test_leases_are_released():
    _, store = run_workload(3, 0, True, steps=200)
    assert store.n > 0
    assert len(store.leases) <= 2 * 3  # at most the last steps' leases are held


def test_host_tier_lru_and_pins():
    t = HostTier(2)
    a, b = t.store(10), t.store(11)
    assert {a, b} == {0, 1}
    assert t.store(12) is None  # both pinned this step: dropped, never refused
    t.unpin_all()
    assert t.store(10) is None  # already held: no copy
    c = t.store(12)  # evicts the least recently used: 11
    assert c == b and t.leading([10, 12]) == [a, c] and t.leading([11]) == []
    t.unpin_all()
    t.take([a])
    assert t.store(13) == c  # a is pinned (read this step): 12 goes instead
    t.check_invariants()


def test_a_short_shared_run_is_not_fetched():
    store = FakeStore()
    store.blocks.update({h: h for h in prompt_hashes(list(range(8)), 2, BS).tolist()})
    tiers = KVTiers(shared=store, layout="L", min_shared_tokens=3 * BS, block_size=BS)
    assert tiers.leading(prompt_hashes(list(range(16)), 4, BS).tolist()) == []
    assert tiers.stats.shared_declined_blocks == 2
    tiers = KVTiers(shared=store, layout="L", min_shared_tokens=2 * BS, block_size=BS)
    assert tiers.leading(prompt_hashes(list(range(16)), 4, BS).tolist()) == [(SHARED, "store0")] * 2


def test_a_long_shared_run_is_not_fetched_past_the_window():
    """kv_share_max_tokens: a run longer than the window is recomputed (counted as declined); one
    inside it is fetched whole."""
    store = FakeStore()
    store.blocks.update({h: h for h in prompt_hashes(list(range(8)), 2, BS).tolist()})
    tiers = KVTiers(shared=store, layout="L", block_size=BS, max_shared_tokens=BS)
    assert tiers.leading(prompt_hashes(list(range(16)), 4, BS).tolist()) == []
    assert tiers.stats.shared_declined_blocks == 2
    tiers = KVTiers(shared=store, layout="L", block_size=BS, max_shared_tokens=2 * BS + BS // 2)
    assert tiers.leading(prompt_hashes(list(range(16)), 4, BS).tolist()) == [(SHARED, "store0")] * 2


def test_second_row_of_a_step_shares_the_first_rows_copy():
    """Two new rows with one host-held prefix: one copy in, the second row shares its block."""
    tiers = KVTiers(host_slots=8, block_size=BS)
    planner = Planner(num_blocks=8, block_size=BS, num_query_heads=1, num_kv_heads=1, enable_cascade=False,
                      tiers=tiers)
    doc = list(range(8))
    planner.plan([ScheduledRequest("a", doc + [1], None)])
    planner.free("a")
    planner.plan([ScheduledRequest("f", list(range(100, 131)), None)])  # 8 blocks: evicts both of a's full ones
    planner.free("f")
    plan = planner.plan([ScheduledRequest("b", doc + [2], None), ScheduledRequest("c", doc + [3], None)])
    t = plan.kv_transfers
    assert len(t.onload_blocks) == 2
    bt = plan.attn.block_table
    assert (bt[0, :2] == t.onload_blocks).all() and (bt[1, :2] == t.onload_blocks).all()
    assert len(tiers.host.leading(prompt_hashes(doc, 2, BS).tolist())) == 2  # still held (inclusive tiers)
