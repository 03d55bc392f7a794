"""Requests admitted in one step share the full blocks an earlier one of that step computes (the
``n`` samples of one prompt): hits, block ids, ref counts, chunked prefill, the last-token rule,
and frees of a sharer or of the request computing the blocks.  Every plan is replayed through a
cache oracle: each row must read, at every position, the K/V of its own prefix."""

import numpy as np
import pytest

from ray_attn.planner import Planner, ScheduledRequest

from .helpers import KVOracle, check_plan

S = ScheduledRequest


def planner(bs, num_blocks=128, **kw):
    return Planner(num_blocks=num_blocks, block_size=bs, num_query_heads=4, num_kv_heads=2, **kw)


def toks(n, seed):
    return np.random.default_rng(seed).integers(1, 50000, n).tolist()


def held_counts(p: Planner, ids) -> np.ndarray:
    held = np.zeros(p.pool.num_blocks, dtype=np.int64)
    for r in ids:
        if p.has_request(r):
            np.add.at(held, p.block_ids(r), 1)
    return held


@pytest.mark.parametrize("bs", [4, 16])
@pytest.mark.parametrize("length", [3, 16, 99, 96, 300])
@pytest.mark.parametrize("n", [2, 4])
def test_samples_admitted_together_compute_the_prompt_once(bs, length, n):
    p, oracle = planner(bs), KVOracle(bs)
    prompt = toks(length, length)
    t = {f"s{i}": list(prompt) for i in range(n)}
    plan = p.plan([S(r, t[r]) for r in t])
    # vLLM's rule: the last prompt token is computed (its logits), so a hit stops a block short
    # when the prompt fills its last block
    hit = (length - 1) // bs * bs
    q = check_plan(p, plan, t)
    assert q.tolist() == [length] + [length - hit] * (n - 1)
    assert plan.num_computed_tokens.tolist() == [0] + [hit] * (n - 1)
    assert plan.num_prefix_cache_hit_tokens == (n - 1) * hit
    own = -(-length // bs)
    assert plan.num_new_blocks == own + (n - 1) * (own - hit // bs)
    first = plan.attn.block_table[0, : hit // bs]
    for i in range(1, n):
        assert plan.attn.block_table[i, : hit // bs].tolist() == first.tolist()
    assert (p.pool.ref_cnt[first] == n).all()
    oracle.step(plan, t)
    for step in range(3):  # decode: the prompt's blocks stay shared, full ones only once
        for r in t:
            t[r].append(7 + step)
        plan = p.plan([S(r, t[r], 1) for r in t])
        check_plan(p, plan, t)
        oracle.step(plan, t)
    full = length // bs
    for r in t:
        assert p.block_ids(r)[:full].tolist() == p.block_ids("s0")[:full].tolist()
    p.pool.check_invariants()
    assert np.array_equal(held_counts(p, t), p.pool.ref_cnt)


def test_a_running_chunk_shares_only_the_blocks_full_after_the_step():
    """a prefills in chunks; b joins while a computes its second chunk, c right after b: each takes
    what the pool holds, then what the rows before it complete in this step -- a part-filled block
    never."""
    bs = 4
    p, oracle = planner(bs), KVOracle(bs)
    prompt = toks(30, 1)
    t = {r: list(prompt) for r in "abc"}
    plan = p.plan([S("a", t["a"], 6)])  # block 0 full, block 1 half
    oracle.step(plan, t)
    a_block1 = int(p.block_ids("a")[1])
    plan = p.plan([S("a", t["a"], 5), S("b", t["b"]), S("c", t["c"])])  # a reaches 11 tokens
    q = check_plan(p, plan, t)
    oracle.step(plan, t)
    # b: block 0 from the pool, block 1 completed by a in this step; a's block 2 is not full
    # c: b computes the rest of the prompt in this step, so c takes all but the last token's block
    assert plan.num_computed_tokens.tolist() == [6, 8, 28]
    assert q.tolist() == [5, 22, 2]
    assert plan.num_prefix_cache_hit_tokens == 8 + 28
    a, b, c = (p.block_ids(r) for r in "abc")
    assert b[:2].tolist() == a[:2].tolist() and b[1] == a_block1
    assert c[:7].tolist() == a[:2].tolist() + b[2:7].tolist()
    assert b[2] != a[2], "a's block 2 is part-filled this step: b computes its own"
    p.pool.check_invariants()
    assert np.array_equal(held_counts(p, "abc"), p.pool.ref_cnt)


def test_a_new_request_in_chunks_shares_only_its_chunk():
    """a, new, computes a first chunk of 6 tokens: b, after it in the step, takes block 0 only."""
    bs = 4
    p, oracle = planner(bs), KVOracle(bs)
    prompt = toks(30, 8)
    t = {"a": list(prompt), "b": list(prompt)}
    plan = p.plan([S("a", t["a"], 6), S("b", t["b"])])
    check_plan(p, plan, t)
    oracle.step(plan, t)
    assert plan.num_computed_tokens.tolist() == [0, 4]
    assert p.block_ids("b")[0] == p.block_ids("a")[0] and p.block_ids("b")[1] != p.block_ids("a")[1]


@pytest.mark.parametrize("num_new,expect_hit", [(14, 0), (6, 8), (2, 12), (None, 12)])
def test_an_explicit_num_new_caps_the_in_step_hit(num_new, expect_hit):
    bs = 4
    p, oracle = planner(bs), KVOracle(bs)
    prompt = toks(14, 2)
    t = {"a": list(prompt), "b": list(prompt)}
    plan = p.plan([S("a", t["a"]), S("b", t["b"], num_new)])
    check_plan(p, plan, t)
    oracle.step(plan, t)
    assert plan.num_computed_tokens.tolist() == [0, expect_hit]
    assert p.stats()["prefix_cache_hits"] == expect_hit


def test_in_step_hits_need_prefix_caching():
    p = planner(4, enable_prefix_caching=False)
    prompt = toks(20, 3)
    plan = p.plan([S("a", prompt), S("b", list(prompt))])
    assert plan.num_computed_tokens.tolist() == [0, 0] and plan.num_prefix_cache_hit_tokens == 0
    assert p.pool.num_shared_blocks == 0


def test_a_hit_on_a_block_the_step_computes_needs_no_allocatable_block():
    """Blocks: a needs 5, b only its last one: the step fits in 6 where computing both prompts
    would need 10."""
    p = planner(4, num_blocks=6)
    prompt = toks(20, 4)
    assert p.can_schedule([S("a", prompt), S("b", list(prompt))])
    assert p.blocks_needed([S("a", prompt), S("b", list(prompt))]) == 6
    plan = p.plan([S("a", prompt), S("b", list(prompt))])
    assert plan.num_new_blocks == 6
    # b's last block, recomputed for its logits, copies a's: indexed, it is deduplicated
    assert p.num_free_blocks == 1 and p.pool.check_invariants() is None


def test_freeing_a_sharer_or_the_computing_request_mid_prefill():
    """a computes blocks 0-3 in step 1; b and c take them in the same step, c stopping mid-prefill.
    c is aborted, then a is preempted (freed) mid-prefill: b keeps the blocks; a comes back and
    takes them from the cache; freed at last, they stay cached until evicted, last in first out."""
    bs = 4
    p, oracle = planner(bs, num_blocks=16), KVOracle(bs)
    prompt = toks(40, 5)
    t = {r: list(prompt) for r in "abc"}
    plan = p.plan([S("a", t["a"], 16), S("b", t["b"]), S("c", t["c"], 2)])
    check_plan(p, plan, t)
    oracle.step(plan, t)
    assert plan.num_computed_tokens.tolist() == [0, 16, 36]  # c: 0-3 from a, 4-8 from b
    a0 = p.block_ids("a")[:4].copy()
    assert (p.pool.ref_cnt[a0] == 3).all()
    p.free("c")  # aborted mid-prefill
    assert (p.pool.ref_cnt[a0] == 2).all()
    assert np.array_equal(held_counts(p, "ab"), p.pool.ref_cnt)
    p.free("a")  # preempted mid-prefill: b still holds what a computed
    assert (p.pool.ref_cnt[a0] == 1).all() and p.block_ids("b")[:4].tolist() == a0.tolist()
    p.pool.check_invariants()
    assert np.array_equal(held_counts(p, "b"), p.pool.ref_cnt)
    t["b"].append(9)
    plan = p.plan([S("b", t["b"], 1), S("a", t["a"])])  # a recomputed: the prompt is cached
    check_plan(p, plan, t)
    oracle.step(plan, t)
    assert plan.num_computed_tokens.tolist() == [40, 36]
    assert p.block_ids("a")[:9].tolist() == p.block_ids("b")[:9].tolist()
    p.free("b")
    p.free("a")
    p.pool.check_invariants()
    # 10 full blocks, shared (a's copy of the last prompt block was deduplicated); b's decode
    # block is not full: free
    assert p.pool.num_used_blocks == 0 and p.pool.num_cached_blocks == 10
    p.plan([S("x", toks(60, 6))])  # 15 blocks: the 6 free ones, then 9 cached evicted
    # released tail first, so evicted tail first: block 0 is what is left of the prompt
    assert p.pool.num_evictions == 9 and p.num_cached_tokens(prompt) == 4
    p.pool.check_invariants()


def test_reset_prefix_cache_forgets_blocks_shared_in_a_step():
    """Failure recovery frees every request, then resets the cache: nothing of the lost step may
    be hit afterwards."""
    p = planner(4)
    prompt = toks(20, 7)
    p.plan([S("a", prompt), S("b", list(prompt))])
    p.free("a")
    p.free("b")
    assert p.num_cached_tokens(prompt) == 16
    p.reset_prefix_cache()
    assert p.num_cached_tokens(prompt) == 0 and p.pool.num_cached_blocks == 0
    plan = p.plan([S("c", list(prompt)), S("d", list(prompt))])
    assert plan.num_computed_tokens.tolist() == [0, 16]
    p.pool.check_invariants()
