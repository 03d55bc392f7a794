"""Cascade plans built by the planner: multi-group structure, vLLM's single group, the fallbacks."""

import numpy as np
import pytest

from ray_attn.planner import Planner, ScheduledRequest, make_local_attention_virtual_batches

from .helpers import check_plan

S = ScheduledRequest
BS = 16


def make(num_prompts, samples, prompt_lens, *, interleave=True, system=0, seed=0, **kw):
    """``num_prompts`` prompts x ``samples`` samples admitted the way an RL rollout would be (one
    sample per prompt first, the others then hit the prefix cache), then one decode token each.
    ``system`` tokens are shared by every prompt.  Returns (planner, tokens, decode batch)."""
    rng = np.random.default_rng(seed)
    args = dict(num_blocks=4000, block_size=BS, num_query_heads=8, num_kv_heads=8)
    args.update(kw)
    p = Planner(**args)
    sys_toks = rng.integers(0, 1000, system).tolist()
    prompts = [sys_toks + rng.integers(1000, 30000, n).tolist() for n in prompt_lens]
    t = {}
    for k in range(num_prompts):
        t[(k, 0)] = list(prompts[k])
    p.plan([S(r, t[r]) for r in t])
    for s in range(1, samples):
        for k in range(num_prompts):
            t[(k, s)] = list(prompts[k])
    p.plan([S(r, t[r]) for r in t if not p.has_request(r)])
    for r in t:  # each sample draws its own token, so the samples diverge
        t[r].append(int(rng.integers(0, 30000)))
    p.plan([S(r, t[r], None) for r in t])
    for r in t:
        t[r].append(int(rng.integers(0, 30000)))
    order = sorted(t, key=(lambda r: (r[1], r[0])) if interleave else (lambda r: r))
    return p, t, [S(r, t[r], 1) for r in order]


def step_blocks(p, plan, i):
    """The blocks request i used in this step (the planner may deduplicate some right after)."""
    return plan.attn.block_table[i, : len(p.block_ids(plan.req_ids[i]))].tolist()


def expected_groups(p, plan, key):
    """Group the plan's requests by ``key(req_id)`` and compute each group's prefix by brute force."""
    groups = {}
    for i, r in enumerate(plan.req_ids):
        groups.setdefault(key(r), []).append(i)
    out = []
    for rows in groups.values():
        lists = [step_blocks(p, plan, i) for i in rows]
        cap = min(int(plan.num_computed_tokens[i]) for i in rows) // BS
        n = 0
        while n < cap and all(len(b) > n and b[n] == lists[0][n] for b in lists):
            n += 1
        out.append((rows, n, lists[0][:n]))
    return out


def check_cascade_structure(p, plan, groups):
    a = plan.attn
    assert a.use_cascade and plan.num_cascade_groups == len(groups)
    B = len(plan.req_ids)
    q = np.diff(a.query_start_loc)
    cu = [0]
    for g, (rows, P, blocks) in enumerate(groups):
        assert rows == list(range(rows[0], rows[0] + len(rows)))  # contiguous in the batch
        assert (plan.cascade_group_ids[rows] == g).all()
        cu.append(cu[-1] + int(q[rows].sum()))
        assert a.prefix_kv_lens[g] == P * BS
        assert a.prefix_block_table[g, :P].tolist() == blocks
        assert not a.prefix_block_table[g, P:].any()
        for i in rows:
            own = step_blocks(p, plan, i)
            assert a.suffix_kv_lens[i] == a.seq_lens[i] - P * BS
            row = a.suffix_block_table[i].tolist()
            assert row[: len(own) - P] == own[P:] and not any(row[len(own) - P:])
    assert a.cu_prefix_query_lens.tolist() == cu and cu[-1] == a.num_actual_tokens
    assert a.common_prefix_len == max(P for _, P, _ in groups) * BS
    assert a.common_prefix_len % BS == 0
    assert a.max_suffix_kv_len == int(a.suffix_kv_lens.max())
    assert a.suffix_kv_lens.shape == (B,) and a.suffix_block_table.shape[0] == B
    for arr in (a.cu_prefix_query_lens, a.prefix_kv_lens, a.prefix_block_table, a.suffix_kv_lens,
                a.suffix_block_table):
        assert arr.dtype == np.int32
    # every group's prefix was computed before the step
    for rows, P, _ in groups:
        assert P >= 1 and (plan.num_computed_tokens[rows] >= P * BS).all()


@pytest.mark.parametrize("num_prompts,samples", [(16, 8), (3, 5), (2, 4)])
def test_multi_group_plan_structure(num_prompts, samples):
    rng = np.random.default_rng(num_prompts)
    lens = rng.integers(300, 700, num_prompts).tolist()
    p, t, batch = make(num_prompts, samples, lens)
    plan = p.plan(batch)
    check_plan(p, plan, t)
    assert plan.cascade_reason.startswith("cascade")
    groups = expected_groups(p, plan, key=lambda r: r[0])
    check_cascade_structure(p, plan, groups)
    for (rows, P, _), n in zip(groups, lens):
        # every full block of the prompt: the one each sample recomputed was deduplicated
        assert P == n // BS
    # group order is the order of first appearance in the scheduled batch, members keep theirs
    assert [plan.req_ids[rows[0]] for rows, _, _ in groups] == [(k, 0) for k in range(num_prompts)]
    assert [plan.req_ids[i][1] for i in groups[0][0]] == list(range(samples))


def test_the_next_step_in_plan_order_keeps_the_groups():
    p, t, batch = make(4, 4, [300, 320, 340, 360])
    plan = p.plan(batch)
    by_id = {s.req_id: s for s in batch}
    for r in t:
        t[r].append(5)
    plan2 = p.plan([by_id[r] for r in plan.req_ids])  # the engine follows the plan's order
    assert plan2.req_ids == plan.req_ids and plan2.attn.use_cascade
    check_plan(p, plan2, t)
    check_cascade_structure(p, plan2, expected_groups(p, plan2, key=lambda r: r[0]))


def test_groups_below_a_shared_system_prompt():
    p, t, batch = make(3, 4, [300, 300, 300], system=48)
    plan = p.plan(batch)
    groups = expected_groups(p, plan, key=lambda r: r[0])
    check_cascade_structure(p, plan, groups)
    assert [P for _, P, _ in groups] == [(48 + 300) // BS] * 3


def test_single_group_is_vllm_cascade():
    # one prompt x 10 samples, vLLM mode: no reordering, G = 1, cu_prefix_query_lens = [0, N]
    p, t, batch = make(1, 10, [400], multi_group_cascade=False)
    plan = p.plan(batch)
    a = plan.attn
    assert a.use_cascade and plan.num_cascade_groups == 1
    assert plan.req_ids == [s.req_id for s in batch]
    assert a.cu_prefix_query_lens.tolist() == [0, a.num_actual_tokens]
    assert a.prefix_kv_lens.tolist() == [a.common_prefix_len] == [400 // BS * BS]
    check_cascade_structure(p, plan, expected_groups(p, plan, key=lambda r: 0))


def test_single_group_mode_refuses_several_prompts():
    p, t, batch = make(4, 4, [300] * 4, multi_group_cascade=False)
    plan = p.plan(batch)
    assert not plan.attn.use_cascade and "common prefix 0" in plan.cascade_reason


def test_prefix_capped_by_what_was_computed_before_the_step():
    # three more samples join in this very step, taking 8 blocks from the cache and computing the
    # rest: a prefix may only cover blocks computed before the step
    p, t, batch = make(1, 8, [300])
    prompt = t[(0, 0)][:300]
    for s in range(8, 11):
        t[(0, s)] = list(prompt)
    joined = batch + [S((0, s), t[(0, s)], 300 - 8 * BS) for s in range(8, 11)]
    plan = p.plan(joined)
    check_plan(p, plan, t)
    assert plan.attn.use_cascade
    gid = dict(zip(plan.req_ids, plan.cascade_group_ids.tolist()))
    check_cascade_structure(p, plan, expected_groups(p, plan, key=gid.get))
    # the 8 running samples share the prompt's 18 full blocks; each newcomer had 8 before the step
    # (one group of 11 with 8 blocks would share less: 10 * 8 < 7 * 18)
    assert plan.attn.prefix_kv_lens.tolist() == [18 * BS, 8 * BS, 8 * BS, 8 * BS]


def test_random_batches_have_sound_groups():
    for seed in range(6):
        rng = np.random.default_rng(seed)
        n = int(rng.integers(2, 6))
        p, t, batch = make(n, int(rng.integers(2, 6)), rng.integers(260, 500, n).tolist(), seed=seed,
                           system=int(rng.choice([0, 40])))
        batch = [batch[i] for i in rng.permutation(len(batch))]
        plan = p.plan(batch)
        check_plan(p, plan, t)
        if plan.attn.use_cascade:
            gid = dict(zip(plan.req_ids, plan.cascade_group_ids.tolist()))
            check_cascade_structure(p, plan, expected_groups(p, plan, key=gid.get))


# --------------------------------------------------------------------------------- fallbacks
def reason(**kw):
    p, t, batch = make(2, 6, [300, 300], **kw)
    plan = p.plan(batch)
    return plan


def test_fallback_disabled():
    plan = reason(enable_cascade=False)
    assert not plan.attn.use_cascade and plan.cascade_reason == "cascade disabled"
    assert plan.attn.cu_prefix_query_lens is None and plan.cascade_group_ids is None


def test_fallback_alibi():
    plan = reason(use_alibi=True)
    assert not plan.attn.use_cascade and "ALiBi" in plan.cascade_reason


def test_fallback_few_requests():
    p, t, batch = make(1, 7, [300])
    plan = p.plan(batch)
    assert not plan.attn.use_cascade and "7 requests < 8" in plan.cascade_reason


def test_fallback_fresh_request_in_batch():
    p, t, batch = make(2, 6, [300, 300])
    t["new"] = list(range(40))
    plan = p.plan(batch + [S("new", t["new"])])
    assert not plan.attn.use_cascade and "no fully computed block" in plan.cascade_reason
    check_plan(p, plan, t)


def test_fallback_heuristic_prefers_flash_decoding():
    # GQA decode with few requests: flash-decoding launches enough CTAs and wins
    p, t, batch = make(2, 5, [300, 300], num_query_heads=32, num_kv_heads=4)
    plan = p.plan(batch)
    assert not plan.attn.use_cascade and "flash-decoding cost" in plan.cascade_reason


def test_sliding_window_that_never_clips_allows_cascade():
    plan = reason(sliding_window=400)  # max seq len is 302 <= 400: no query's window clips
    assert plan.attn.use_cascade
    plan = reason(sliding_window=302)
    assert plan.attn.use_cascade
    plan = reason(sliding_window=301)  # the last query (position 301) would not see position 0
    assert not plan.attn.use_cascade and "sliding window 301 clips" in plan.cascade_reason


def test_local_attention_within_one_chunk_allows_cascade():
    plan = reason(attention_chunk_size=512)
    assert plan.attn.use_cascade and plan.attn.local_attn_metadata is None
    plan = reason(attention_chunk_size=256)
    a = plan.attn
    assert not a.use_cascade and "several chunks" in plan.cascade_reason
    m = a.local_attn_metadata
    sq, cuq, sk, tab = make_local_attention_virtual_batches(256, a.query_start_loc, a.seq_lens, a.block_table, BS)
    assert np.array_equal(m.local_query_start_loc, cuq) and np.array_equal(m.local_seqused_k, sk)
    assert np.array_equal(m.local_block_table, tab)
    assert m.local_max_query_len == int(sq.max()) and m.local_max_seq_len == int(sk.max())


def test_no_sharing_reason():
    p = Planner(num_blocks=400, block_size=BS, num_query_heads=8, num_kv_heads=8)
    t = {i: list(range(i * 1000, i * 1000 + 300)) for i in range(10)}
    p.plan([S(r, t[r]) for r in t])
    for r in t:
        t[r].append(1)
    plan = p.plan([S(r, t[r], 1) for r in t])
    assert not plan.attn.use_cascade and "share" in plan.cascade_reason


@pytest.mark.parametrize("plan_order", [False, True])
def test_reused_verdict_equals_a_fresh_one(plan_order, monkeypatch):
    """Decode steps of an unchanged batch reuse the group search; the plans must be identical to
    ones searched from scratch, in the engine's order or the plan's."""
    import ray_attn.planner.cascade as cascade

    searches = []
    search = cascade.find_prefix_groups
    monkeypatch.setattr(cascade, "find_prefix_groups", lambda *a: searches.append(1) or search(*a))

    def run(fresh):
        p, t, batch = make(3, 4, [290, 295, 300], sliding_window=306)
        searches.clear()  # make()'s last step searched this batch already
        out = []
        for step in range(6):  # max seq goes 302 .. 307: the window starts to clip at 307
            if fresh:
                p._cascade_cache = ()
            plan = p.plan(batch)
            out.append(plan)
            if plan_order:
                by_id = {s.req_id: s for s in batch}
                batch = [by_id[r] for r in plan.req_ids]
            for s in batch:
                s.token_ids.append(step)
        return out
    reused = run(False)
    assert not searches  # every step reused the verdict, in either order
    fresh = run(True)
    assert [p.attn.use_cascade for p in reused] == [True] * 5 + [False]
    for a, b in zip(reused, fresh, strict=True):
        assert a.req_ids == b.req_ids and a.cascade_reason == b.cascade_reason
        for f in ("cu_prefix_query_lens", "prefix_kv_lens", "prefix_block_table", "suffix_kv_lens",
                  "suffix_block_table", "block_table", "slot_mapping", "seq_lens"):
            x, y = getattr(a.attn, f), getattr(b.attn, f)
            assert (x is None and y is None) or np.array_equal(x, y), f
    assert a.attn.use_cascade is False and "clips" in a.cascade_reason


def test_toggling_cascade_between_steps():
    p, t, batch = make(2, 5, [300, 300])
    assert p.plan(batch).attn.use_cascade
    p.enable_cascade = False
    for s in batch:
        s.token_ids.append(1)
    assert p.plan(batch).cascade_reason == "cascade disabled"
    p.enable_cascade = True
    p.num_sms = 8
    assert p.cascade_config.num_sms == 8
    for s in batch:
        s.token_ids.append(2)
    assert p.plan(batch).attn.use_cascade


@pytest.mark.parametrize("multi_group", [True, False])
def test_measured_policy_cascades_exactly_when_enough_kv_is_saved(multi_group):
    """The measured policy (GPU kernels) compares the KV tokens cascade saves per layer,
    sum_g (n_g - 1) * P_g, with its threshold; it replaces vLLM's CTA model, not its gates."""
    prompts, samples = (4, 4) if multi_group else (1, 8)  # vLLM's gate: at least 8 requests
    saved = prompts * (samples - 1) * (400 // BS * BS)  # 25 full blocks shared per prompt
    for threshold, expect in ((saved, True), (saved + 1, False)):
        q, _, b = make(prompts, samples, [400] * prompts, multi_group_cascade=multi_group,
                       cascade_min_saved_kv_tokens=threshold)
        plan = q.plan(b)
        assert plan.attn.use_cascade is expect, plan.cascade_reason
        assert f"saves {saved} KV tokens" in plan.cascade_reason


def test_engine_threshold_is_kv_bytes_per_layer():
    """1 GiB of KV per layer when steps run eagerly, 96 MiB when decode replays CUDA graphs."""
    from ray_attn.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
    from ray_attn.engine import cascade_threshold

    llama8b = ModelConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                          intermediate_size=14336, dtype="bfloat16")
    eager = EngineConfig(model=llama8b, parallel=ParallelConfig(cuda_graphs="off"))
    assert cascade_threshold(eager, "fa3") == (1 << 30) // (2 * 8 * 128 * 2) == 262144
    fp8 = EngineConfig(model=llama8b, cache=CacheConfig(kv_cache_dtype="fp8"),
                       parallel=ParallelConfig(cuda_graphs="off"))
    assert cascade_threshold(fp8, "fa3") == 2 * 262144
    graphed = EngineConfig(model=llama8b)  # auto: graphs
    assert cascade_threshold(graphed, "fa3") == (96 << 20) // (2 * 8 * 128 * 2) == 24576
    tp2 = EngineConfig(model=llama8b, parallel=ParallelConfig(tensor_parallel_size=2))
    assert cascade_threshold(tp2, "fa3") == (96 << 20) // (2 * 4 * 128 * 2)  # auto: graphs at TP>1 too
    assert cascade_threshold(graphed, "torch") is None
    # What the ranks report wins over the config's rule (a failed capture runs eagerly).
    assert cascade_threshold(graphed, "fa3", graphs=False) == 262144
