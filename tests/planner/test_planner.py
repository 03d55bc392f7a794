"""Planner: step plans checked token by token, prefix caching, the engine protocol, bad input."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ray_attn.planner import (
    DoubleFreeError,
    InvalidRequestError,
    OutOfBlocksError,
    Planner,
    PlannerConfigError,
    ScheduledRequest,
    UnknownRequestError,
)

from .helpers import KVOracle, check_plan, same_state, snapshot

S = ScheduledRequest


def planner(**kw):
    args = dict(num_blocks=64, block_size=4, num_query_heads=8, num_kv_heads=2)
    args.update(kw)
    return Planner(**args)


def toks(n, seed=0, lo=0):
    return np.random.default_rng(seed).integers(lo, 50000, n).tolist()


def test_planner_imports_no_torch():
    code = "import sys, ray_attn.planner; print('torch' in sys.modules)"
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert out.stdout.strip() == "False"


def test_prefill_then_decode_token_by_token():
    p = planner()
    t = {"a": toks(10, 1), "b": toks(3, 2), "c": toks(9, 3)}
    plan = p.plan([S(r, t[r]) for r in t])
    q = check_plan(p, plan, t, {"a": 0, "b": 0, "c": 0})
    assert q.tolist() == [10, 3, 9] and plan.req_ids == ["a", "b", "c"]
    assert plan.num_new_blocks == 3 + 1 + 3
    for step in range(9):
        for r in t:
            t[r].append(100 + step)
        before = {r: p.num_computed_tokens(r) for r in t}
        plan = p.plan([S(r, t[r], 1) for r in t])
        assert check_plan(p, plan, t, before).tolist() == [1, 1, 1]
        assert plan.attn.max_query_len == 1
    assert p.num_computed_tokens("a") == 19
    p.pool.check_invariants()


def test_decode_fast_path_equals_general_path():
    def run(force_general):
        p = planner(num_blocks=200)
        t = {i: toks(5 + 3 * i, i) for i in range(9)}
        out = [p.plan([S(r, t[r]) for r in t])]
        for step in range(12):
            for r in t:
                t[r].append(step)
            if force_general:
                p._prev = None
            out.append(p.plan([S(r, t[r], 1) for r in t]))
        return out
    for fast, slow in zip(run(False), run(True)):
        for name in ("input_token_ids", "positions", "logits_indices", "num_computed_tokens"):
            assert np.array_equal(getattr(fast, name), getattr(slow, name))
        for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
            assert np.array_equal(getattr(fast.attn, name), getattr(slow.attn, name))
        assert fast.req_ids == slow.req_ids


def test_same_objects_in_plan_order_take_the_fast_path():
    p = planner(num_blocks=200)
    reqs = [S(i, toks(6, i)) for i in range(5)]
    plan = p.plan(reqs)
    for r in reqs:
        r.token_ids.append(7)
        r.num_new_tokens = 1
    by_id = {r.req_id: r for r in reqs}
    again = [by_id[i] for i in plan.req_ids][::-1]  # a different order: the general path
    plan = p.plan(again)
    assert plan.req_ids == [4, 3, 2, 1, 0]
    for r in reqs:
        r.token_ids.append(8)
    plan2 = p.plan(again)  # the same objects again: fast path
    check_plan(p, plan2, {r.req_id: r.token_ids for r in reqs})


def test_prefix_cache_hit_shares_full_blocks():
    p = planner()
    prompt = toks(14, 5)  # 3 full blocks of 4 + 2 tokens
    p.plan([S("a", prompt)])
    plan = p.plan([S("b", list(prompt))])
    assert plan.num_prefix_cache_hit_tokens == 12
    assert plan.num_computed_tokens.tolist() == [12]
    check_plan(p, plan, {"b": prompt}, {"b": 12})
    a, b = p.block_ids("a"), p.block_ids("b")
    assert a[:3].tolist() == b[:3].tolist() and a[3] != b[3]
    assert (p.pool.ref_cnt[a[:3]] == 2).all() and p.pool.num_shared_blocks == 3
    assert p.stats()["prefix_cache_hits"] == 12


def test_hit_leaves_the_last_token_to_compute():
    p = planner()
    prompt = toks(12, 6)  # exactly 3 blocks
    p.plan([S("a", prompt)])
    plan = p.plan([S("b", list(prompt))])
    # vLLM recomputes the last token for its logits: only 2 of the 3 blocks are hits
    assert plan.num_computed_tokens.tolist() == [8]
    assert np.diff(plan.attn.query_start_loc).tolist() == [4]


def test_explicit_num_new_caps_the_hit():
    p = planner()
    prompt = toks(14, 7)
    p.plan([S("a", prompt)])
    assert p.num_cached_tokens(prompt) == 12
    assert p.num_cached_tokens(prompt, 14) == 0
    assert p.num_cached_tokens(prompt, 6) == 8
    plan = p.plan([S("b", list(prompt), 6)])  # 6 new tokens must fit: hit capped at 8
    assert plan.num_computed_tokens.tolist() == [8]
    check_plan(p, plan, {"b": prompt})


def test_freed_blocks_stay_cached_until_evicted_lru():
    p = planner(num_blocks=8)
    pa, pb = toks(9, 10), toks(9, 11)  # 2 full blocks + 1 each
    p.plan([S("a", pa)])
    p.plan([S("b", pb)])
    p.free("a")
    p.free("b")
    assert p.pool.num_cached_blocks == 4 and p.num_free_blocks == 8
    plan = p.plan([S("a2", list(pa))])
    assert plan.num_computed_tokens.tolist() == [8]  # a's blocks came back
    p.free("a2")
    # fill the pool: the least recently freed cached blocks (b's) go first
    p.plan([S("x", toks(20, 12))])  # 4 free blocks + 1 evicted
    assert p.num_cached_tokens(pa) == 8 and p.num_cached_tokens(pb) == 4
    p.plan([S("y", toks(4, 13))])
    assert p.num_cached_tokens(pb) == 0
    p.pool.check_invariants()


def test_decode_blocks_are_cached_when_the_request_is_freed():
    p = planner()
    t = toks(5, 20)
    p.plan([S("a", t)])
    for step in range(8):
        t.append(500 + step)
        p.plan([S("a", t, 1)])
    assert p.table.num_hashed[p.table.slot_of["a"]] == 1  # decode blocks: not indexed yet
    p.free("a")
    assert p.num_cached_tokens(t + [1]) == 12  # 13 computed tokens: 3 full blocks


def test_chunked_prefill():
    p = planner()
    t = toks(11, 30)
    plan = p.plan([S("a", t, 5)])
    assert not plan.completes_prompt([11])[0]
    check_plan(p, plan, {"a": t}, {"a": 0})
    plan = p.plan([S("a", t, 6)])
    assert plan.completes_prompt([11])[0]
    check_plan(p, plan, {"a": t}, {"a": 5})
    assert p.block_ids("a").size == 3


def test_allocate_then_plan():
    p = planner()
    t = toks(10, 40)
    assert p.allocate("a", t) == 0
    assert p.block_ids("a").size == 3
    free = p.num_free_blocks
    plan = p.plan([S("a", t)])
    assert plan.num_new_blocks == 0 and p.num_free_blocks == free
    check_plan(p, plan, {"a": t})
    t.append(1)
    assert p.blocks_needed([S("a", t, 1)]) == 0
    p.plan([S("a", t, 1)])
    t.append(2)
    p.plan([S("a", t, 1)])  # 12 tokens: 3 full blocks
    t.append(3)
    assert p.blocks_needed([S("a", t, 1)]) == 1


def test_token_buckets_pad_with_minus_one_slots():
    p = planner(token_buckets=[8, 16, 32])
    t = {"a": toks(5, 1), "b": toks(6, 2)}
    plan = p.plan([S(r, t[r]) for r in t])
    assert plan.attn.num_actual_tokens == 11 and plan.num_tokens == 16
    check_plan(p, plan, t)
    assert plan.attn.slot_mapping[11:].tolist() == [-1] * 5
    big = p.plan([S("c", toks(40, 3))])
    assert big.num_tokens == 40  # larger than every bucket: no padding


def test_numpy_token_ids_and_any_hashable_ids():
    p = planner()
    t = np.arange(9, dtype=np.int64) + 3
    plan = p.plan([S(("user", 1), t)])
    check_plan(p, plan, {("user", 1): t.tolist()})
    p.plan([S(("user", 1), np.append(t, 4), 1)])
    plan = p.plan([S(("user", 2), t.copy())])
    assert plan.num_computed_tokens.tolist() == [8]


def test_empty_step():
    plan = planner().plan([])
    assert plan.req_ids == [] and plan.attn.num_actual_tokens == 0 and plan.num_tokens == 0


# --------------------------------------------------------------------------------- bad input
def setup_two():
    p = planner(num_blocks=16)
    t = {"a": toks(6, 1), "b": toks(5, 2)}
    p.plan([S(r, t[r]) for r in t])
    for r in t:
        t[r].append(9)
    return p, t


BAD_STEPS = [
    ("zero new tokens", lambda t: [S("a", t["a"], 0)], InvalidRequestError, "num_new_tokens 0"),
    ("negative", lambda t: [S("a", t["a"], -2)], InvalidRequestError, "-2"),
    ("too many", lambda t: [S("a", t["a"], 2)], InvalidRequestError, "num_new_tokens 2"),
    ("decode past the end", lambda t: [S("a", t["a"][:-1], 1), S("b", t["b"], 1)], InvalidRequestError, "'a'"),
    ("shrunk tokens", lambda t: [S("a", t["a"][:3])], InvalidRequestError, "'a'"),
    ("new too many", lambda t: [S("c", [1, 2], 3)], InvalidRequestError, "'c'"),
    ("new zero", lambda t: [S("c", [1, 2], 0)], InvalidRequestError, "'c'"),
    ("new empty prompt", lambda t: [S("c", [])], InvalidRequestError, "'c'"),
    ("duplicate ids", lambda t: [S("a", t["a"], 1), S("a", t["a"], 1)], InvalidRequestError, "twice"),
    ("not an int", lambda t: [S("a", t["a"], "x")], InvalidRequestError, "int"),
    ("bad tokens", lambda t: [S("c", ["x", "y"])], InvalidRequestError, "int"),
    ("None id", lambda t: [S(None, [1, 2])], InvalidRequestError, "None"),
    ("out of blocks", lambda t: [S("c", list(range(100)))], OutOfBlocksError, "need"),
    ("out of blocks, many", lambda t: [S(f"n{i}", toks(9, i + 50)) for i in range(6)], OutOfBlocksError, "need"),
]


@pytest.mark.parametrize("name,step,err,match", BAD_STEPS, ids=[b[0] for b in BAD_STEPS])
def test_bad_step_raises_typed_error_and_changes_nothing(name, step, err, match):
    p, t = setup_two()
    p.plan([S(r, t[r], 1) for r in t])  # warm the fast path
    for r in t:
        t[r].append(3)
    before = snapshot(p)
    with pytest.raises(err, match=match):
        p.plan(step(t))
    assert same_state(before, snapshot(p))
    if err is OutOfBlocksError:
        assert not p.can_schedule(step(t))
    # the planner still works
    plan = p.plan([S(r, t[r], 1) for r in t])
    check_plan(p, plan, t)


def test_out_of_blocks_in_the_decode_path_changes_nothing():
    p = planner(num_blocks=4)
    t = {i: toks(4, i) for i in range(4)}  # every block full
    p.plan([S(r, t[r]) for r in t])
    for r in t:
        t[r].append(1)
    before = snapshot(p)
    with pytest.raises(OutOfBlocksError) as e:
        p.plan([S(r, t[r], 1) for r in t])
    assert e.value.num_needed == 4 and e.value.num_available == 0
    assert same_state(before, snapshot(p))
    p.free(3)  # preempt two; their full blocks stay cached, and evictable
    p.free(2)
    plan = p.plan([S(r, t[r], 1) for r in range(2)])
    assert p.pool.num_evictions == 2
    check_plan(p, plan, t)


def test_unknown_and_double_free():
    p, t = setup_two()
    with pytest.raises(UnknownRequestError, match="'zz'") as e:
        p.free("zz")
    assert isinstance(e.value, KeyError)
    p.free("a")
    before = snapshot(p)
    with pytest.raises(DoubleFreeError, match="already freed"):
        p.free("a")
    with pytest.raises(UnknownRequestError):
        p.num_computed_tokens("a")
    assert same_state(before, snapshot(p))
    p.plan([S("a", t["a"])])  # re-admitted (preemption by recompute): fine
    assert p.has_request("a")


def test_max_model_len():
    p = planner(max_model_len=8)
    with pytest.raises(InvalidRequestError, match="max_model_len 8"):
        p.plan([S("a", toks(9))])
    t = toks(8)
    p.plan([S("a", t)])
    before = snapshot(p)
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        p.plan([S("a", t + [1], 1)])
    assert same_state(before, snapshot(p))


@pytest.mark.parametrize("kw,match", [
    (dict(attention_chunk_size=6), "not a multiple of block_size 4"),
    (dict(attention_chunk_size=0), "attention_chunk_size"),
    (dict(num_query_heads=6, num_kv_heads=4), "not a multiple of num_kv_heads"),
    (dict(num_blocks=0), "num_blocks"),
    (dict(block_size=-4), "block_size"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(num_sms=0), "num_sms"),
    (dict(num_sms=True), "num_sms"),
    (dict(token_buckets=[8, -1]), "bucket"),
    (dict(max_model_len=2.5), "max_model_len"),
])
def test_bad_config(kw, match):
    with pytest.raises(PlannerConfigError, match=match) as e:
        planner(**kw)
    assert isinstance(e.value, ValueError)


def test_set_num_sms():
    p = planner()
    p.set_num_sms(78)
    assert p.num_sms == 78 and p.cascade_config.num_sms == 78
    with pytest.raises(PlannerConfigError):
        p.set_num_sms(-1)


# --------------------------------------------------------------------------------- an engine
@pytest.mark.parametrize("seed", range(8))
def test_random_engine_run(seed):
    """Admissions (with shared prompts), chunked prefill, decode, frees and preemption, with every
    plan recomputed token by token and the pool's books checked after each step."""
    rng = np.random.default_rng(seed)
    bs = int(rng.choice([2, 4, 16]))
    p = Planner(num_blocks=int(rng.integers(20, 80)), block_size=bs, num_query_heads=4, num_kv_heads=2,
                enable_prefix_caching=bool(seed % 4 != 3), attention_chunk_size=4 * bs if seed % 2 else None,
                token_buckets=[16, 64] if seed % 3 == 0 else None)
    prompts = [toks(int(rng.integers(1, 6 * bs)), 100 + k) for k in range(4)]
    running, nxt, oracle = {}, 0, KVOracle(bs)
    for step in range(40):
        sched = []
        if rng.random() < 0.4 or not running:
            base = prompts[int(rng.integers(len(prompts)))]
            running[nxt] = list(base) + toks(int(rng.integers(0, 3)), 1000 + nxt)
            nxt += 1
        for r, t in running.items():
            if not p.has_request(r):
                sched.append(S(r, t, None if rng.random() < 0.7 else min(len(t), int(rng.integers(1, 9)))))
            else:
                left = len(t) - p.num_computed_tokens(r)
                sched.append(S(r, t, int(rng.integers(1, left + 1)) if left > 1 else 1))
        before = {s.req_id: (p.num_computed_tokens(s.req_id) if p.has_request(s.req_id) else None) for s in sched}
        try:
            plan = p.plan(sched)
        except OutOfBlocksError:
            victim = max(r for r in running if p.has_request(r)) if any(p.has_request(r) for r in running) else None
            if victim is None:
                running.clear()
                continue
            p.free(victim)  # preempt by recompute: it starts over next step
            continue
        q = check_plan(p, plan, running)
        oracle.step(plan, running)
        for i, r in enumerate(plan.req_ids):
            if before[r] is not None:
                assert plan.num_computed_tokens[i] == before[r]
            if plan.num_computed_tokens[i] + q[i] == len(running[r]):
                running[r].append(int(rng.integers(0, 50000)))
        p.pool.check_invariants()
        # every used block is held exactly ref_cnt times across the running requests
        held = np.zeros(p.pool.num_blocks, dtype=np.int64)
        for r in list(running):
            if p.has_request(r):
                np.add.at(held, p.block_ids(r), 1)
        assert np.array_equal(held, p.pool.ref_cnt)
        for r in list(running):
            if rng.random() < 0.08 and p.has_request(r):
                p.free(r)
                del running[r]


def test_empty_steps_twice_then_work():
    p = planner(max_model_len=64)
    p.plan([])
    p.plan([])
    t = toks(5)
    plan = p.plan([S("a", t)])
    check_plan(p, plan, {"a": t})
