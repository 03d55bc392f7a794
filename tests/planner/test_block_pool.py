"""BlockPool: unit tests, the chain hash, and a hypothesis state machine of the allocator."""

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ray_attn.planner import BlockPool, DoubleFreeError, OutOfBlocksError, Planner, PlannerConfigError, ScheduledRequest
from ray_attn.planner.block_pool import ROOT_HASH, chain_hashes, content_hashes, prompt_hashes

from .helpers import same_state, snapshot


def pool_state(pool):
    return (pool.ref_cnt.copy(), list(pool._free), list(pool._evictable), dict(pool._block_of),
            dict(pool._key_of), pool.num_shared_blocks, pool.num_evictions)


def test_allocate_release_counts():
    pool = BlockPool(10, 4)
    a = pool.allocate(3)
    assert a.tolist() == [0, 1, 2] and a.dtype == np.int32
    assert pool.num_free_blocks == 7 and pool.num_used_blocks == 3
    pool.release(a)
    assert pool.num_free_blocks == 10 and pool.num_cached_blocks == 0
    pool.check_invariants()


def test_failed_allocation_changes_nothing():
    pool = BlockPool(6, 4)
    pool.allocate(2)
    before = pool_state(pool)
    with pytest.raises(OutOfBlocksError, match="need 5 blocks but only 4") as e:
        pool.allocate(5)
    assert (e.value.num_needed, e.value.num_available) == (5, 4)
    assert same_state(before, pool_state(pool))
    with pytest.raises(ValueError):
        pool.allocate(-1)


def test_double_release():
    pool = BlockPool(4, 4)
    a = pool.allocate(2)
    pool.release(a)
    before = pool_state(pool)
    with pytest.raises(DoubleFreeError, match="already free"):
        pool.release(a)
    with pytest.raises(DoubleFreeError, match="twice"):
        pool.release([3, 3])
    assert same_state(before, pool_state(pool))


def test_bad_sizes():
    with pytest.raises(PlannerConfigError):
        BlockPool(0, 4)
    with pytest.raises(PlannerConfigError):
        BlockPool(4, 0)


def test_cached_blocks_revive_and_evict_lru():
    pool = BlockPool(4, 2)
    t = [1, 2, 3, 4, 5, 6]
    blocks = pool.allocate(3)
    pool.cache_blocks(blocks.tolist(), prompt_hashes(t, 3, 2).tolist())
    pool.release(blocks)
    assert pool.num_cached_blocks == 3 and pool.num_free_blocks == 4
    ids, last = pool.lookup(t, 3)
    assert ids == blocks.tolist() and last == int(prompt_hashes(t, 3, 2)[-1])
    assert pool.lookup(t, 2)[0] == blocks[:2].tolist()
    assert pool.lookup([1, 2, 3, 9], 2)[0] == blocks[:1].tolist()
    assert pool.lookup([9, 2], 1) == ([], ROOT_HASH)
    pool.acquire(ids[:1])
    assert pool.ref_cnt[ids[0]] == 1 and pool.num_cached_blocks == 2
    # two fresh allocations: the free block first, then the least recently freed cached block,
    # which is the request's tail (released first)
    got = pool.allocate(2)
    assert got.tolist() == [3, int(blocks[2])]
    assert pool.lookup(t, 3)[0] == blocks[:2].tolist()
    assert pool.num_evictions == 1
    pool.check_invariants()


def test_cache_keeps_the_older_block():
    pool = BlockPool(4, 2)
    h = prompt_hashes([1, 2], 1, 2).tolist()
    a, b = pool.allocate(2).tolist()
    pool.cache_blocks([a], h)
    pool.cache_blocks([b], h)
    assert pool.lookup([1, 2, 3], 1)[0] == [a] and not pool.is_cached(b)


def test_reset_prefix_cache():
    pool = BlockPool(4, 2)
    a = pool.allocate(2)
    pool.cache_blocks(a.tolist(), prompt_hashes([1, 2, 3, 4], 2, 2).tolist())
    pool.release(a[1:])
    assert pool.reset_prefix_cache() == 1
    assert pool.num_cached_blocks == 0 and pool.lookup([1, 2, 3, 4], 2)[0] == [int(a[0])]
    pool.check_invariants()


def test_prefix_caching_disabled():
    pool = BlockPool(4, 2, enable_prefix_caching=False)
    a = pool.allocate(1)
    pool.cache_blocks(a.tolist(), prompt_hashes([1, 2], 1, 2).tolist())
    pool.release(a)
    assert pool.lookup([1, 2, 3], 1)[0] == [] and pool.num_cached_blocks == 0


def sequential_chain(tokens, bs, parent=ROOT_HASH):
    m = (1 << 64) - 1
    M = 0x9E3779B97F4A7C15
    out = []
    for j in range(len(tokens) // bs):
        c = int(content_hashes(np.array([tokens[j * bs:(j + 1) * bs]]))[0])
        parent = (parent * M + c) & m
        out.append(parent)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_chain_hash_closed_form_matches_recurrence(seed):
    rng = np.random.default_rng(seed)
    bs = int(rng.choice([1, 2, 16]))
    seqs = [rng.integers(0, 2**31 - 1, bs * int(rng.integers(1, 30))).tolist() for _ in range(4)]
    parents = [int(x) for x in rng.integers(0, 2**63, 4)]
    counts = [len(s) // bs for s in seqs]
    content = content_hashes(np.concatenate([np.array(s).reshape(-1, bs) for s in seqs]))
    got = chain_hashes(content, counts, np.array(parents, dtype=np.uint64)).tolist()
    want = sum((sequential_chain(s, bs, p) for s, p in zip(seqs, parents)), [])
    assert got == want
    assert prompt_hashes(seqs[0], counts[0], bs).tolist() == sequential_chain(seqs[0], bs)


def test_hash_depends_on_order_position_and_prefix():
    h = lambda t: prompt_hashes(t, len(t) // 2, 2).tolist()  # noqa: E731
    assert h([1, 2, 3, 4])[0] == h([1, 2, 9, 9])[0]
    assert h([1, 2, 3, 4])[1] != h([5, 6, 3, 4])[1]  # same block, other prefix
    assert h([1, 2])[0] != h([2, 1])[0]
    assert len(set(h(list(range(2000))))) == 1000


# --------------------------------------------------------------------------------- state machine
BS = 2
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 9, 9], [8, 8, 8, 8, 8]]


class PoolMachine(RuleBasedStateMachine):
    """Requests built on the pool the way the planner does: prefix hits, allocation, caching."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(12, BS)
        self.reqs = {}  # id -> [tokens, blocks]
        self.next_id = 0
        self.released = []

    def _cache_full(self, tokens, blocks):
        full = len(tokens) // BS
        self.pool.cache_blocks(blocks[:full], prompt_hashes(tokens, full, BS).tolist())

    @rule(prompt=st.sampled_from(range(len(PROMPTS))), tail=st.lists(st.integers(0, 3), max_size=4))
    def admit(self, prompt, tail):
        tokens = PROMPTS[prompt] + tail
        hits, _ = self.pool.lookup(tokens, (len(tokens) - 1) // BS)
        need = -(-len(tokens) // BS) - len(hits)
        available = self.pool.num_free_blocks - sum(self.pool.is_evictable(b) for b in hits)
        if need > available:
            return
        self.pool.acquire(hits)
        blocks = hits + self.pool.allocate(need).tolist()
        self._cache_full(tokens, blocks)
        self.reqs[self.next_id] = [tokens, blocks]
        self.next_id += 1

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), n=st.integers(1, 5))
    def grow(self, data, n):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        tokens, blocks = self.reqs[rid]
        new_tokens = tokens + [7] * n
        need = -(-len(new_tokens) // BS) - len(blocks)
        if need > self.pool.num_free_blocks:
            before = pool_state(self.pool)
            with pytest.raises(OutOfBlocksError):
                self.pool.allocate(need)
            assert same_state(before, pool_state(self.pool))
            return
        blocks += self.pool.allocate(need).tolist()
        tokens[:] = new_tokens
        self._cache_full(tokens, blocks)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        tokens, blocks = self.reqs.pop(rid)
        self.pool.release(blocks)
        self.released = blocks

    @rule(extra=st.integers(1, 5))
    def failed_allocation(self, extra):
        before = pool_state(self.pool)
        with pytest.raises(OutOfBlocksError):
            self.pool.allocate(self.pool.num_free_blocks + extra)
        assert same_state(before, pool_state(self.pool))

    @precondition(lambda self: self.released)
    @rule()
    def double_free(self):
        still_held = {b for _, bl in self.reqs.values() for b in bl}
        if still_held & set(self.released):
            return  # a shared block: the second release is legitimate for its other holder
        before = pool_state(self.pool)
        with pytest.raises(DoubleFreeError):
            self.pool.release(self.released)
        assert same_state(before, pool_state(self.pool))

    @rule()
    def reset(self):
        self.pool.reset_prefix_cache()

    @invariant()
    def books_balance(self):
        pool = self.pool
        pool.check_invariants()
        assert pool.num_uncached_free_blocks + pool.num_used_blocks + pool.num_cached_blocks == pool.num_blocks
        assert (pool.ref_cnt >= 0).all()
        holders = {}
        for rid, (tokens, blocks) in self.reqs.items():
            assert len(set(blocks)) == len(blocks)
            for j, b in enumerate(blocks):
                holders.setdefault(b, []).append((rid, j))
        for b in range(pool.num_blocks):
            assert pool.ref_cnt[b] == len(holders.get(b, []))
        for b, hs in holders.items():
            if len(hs) > 1:  # only a shared prefix block: cached, same column, same tokens before
                assert pool.is_cached(b)
                cols = {j for _, j in hs}
                assert len(cols) == 1
                j = cols.pop()
                prefixes = {tuple(self.reqs[rid][0][: (j + 1) * BS]) for rid, _ in hs}
                assert len(prefixes) == 1


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])


class PlannerMachine(RuleBasedStateMachine):
    """The same books, kept by the planner through its public API."""

    def __init__(self):
        super().__init__()
        self.p = Planner(num_blocks=14, block_size=BS, num_query_heads=4, num_kv_heads=2)
        self.tokens = {}
        self.next_id = 0

    @rule(prompt=st.sampled_from(range(len(PROMPTS))), tail=st.lists(st.integers(0, 3), max_size=3))
    def admit(self, prompt, tail):
        t = PROMPTS[prompt] + tail
        before = snapshot(self.p)
        try:
            self.p.plan([ScheduledRequest(self.next_id, t)])
        except OutOfBlocksError:
            assert same_state(before, snapshot(self.p))
            return
        self.tokens[self.next_id] = t
        self.next_id += 1

    @precondition(lambda self: self.tokens)
    @rule(tok=st.integers(0, 3))
    def decode_all(self, tok):
        for t in self.tokens.values():
            t.append(tok)
        sched = [ScheduledRequest(r, t, 1) for r, t in self.tokens.items()]
        before = snapshot(self.p)
        try:
            self.p.plan(sched)
        except OutOfBlocksError:
            assert same_state(before, snapshot(self.p))
            for t in self.tokens.values():
                t.pop()

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.p.free(rid)
        del self.tokens[rid]

    @invariant()
    def books_balance(self):
        p = self.p
        p.pool.check_invariants()
        seen = {}
        for rid in self.tokens:
            for j, b in enumerate(p.block_ids(rid).tolist()):
                seen.setdefault(b, []).append((rid, j))
        for b in range(p.pool.num_blocks):
            assert p.pool.ref_cnt[b] == len(seen.get(b, []))
        for b, hs in seen.items():
            if len(hs) > 1:
                assert p.pool.is_cached(b) and len({j for _, j in hs}) == 1
                j = hs[0][1]
                assert len({tuple(self.tokens[r][: (j + 1) * BS]) for r, _ in hs}) == 1


TestPlannerMachine = PlannerMachine.TestCase
TestPlannerMachine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])
