"""Batch-invariant mode's cascade on a fixed grid (ray_attn/planner/invariant.py).

Every token at position t is attended as a prefix pass over [0, (t // grid) * grid) and a suffix
pass over the rest, merged by LSE; rows group by their prefix blocks whoever else is in the step.
Checked here: the grouping, the refusal of a query that crosses a line (before any state
changes), the plans' attention against float64 dense attention through the backend (rows below
the first line in a group of prefix 0 beside cascaded ones), the scheduler's chunks and the
speculative decoder's drafts stopping at the lines, and the config that turns it on.
"""

from __future__ import annotations

import numpy as np
import pytest

from ray_attn.planner import InvalidRequestError, Planner, ScheduledRequest
from ray_attn.planner.invariant import cascade_grid, check_grid, grid_cascade, grid_room
from tests.planner.helpers import same_state, snapshot

S = ScheduledRequest
BS, GRID = 16, 64


def test_rows_group_by_their_prefix_blocks_whoever_else_is_in_the_step():
    table = np.array([
        [7, 8, 9, 1, 2, 3, 4, 5, 0, 0, 0, 0, 0],
        [7, 8, 9, 1, 6, 0, 0, 0, 0, 0, 0, 0, 0],  # same first 4 blocks as row 0
        [3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # below the first line: prefix 0
        [7, 8, 9, 1, 2, 3, 4, 5, 10, 11, 12, 13, 14],  # past the third line: its own 12 blocks
        [7, 8, 9, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0],  # 4 blocks, one of them not row 0's
        [4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # prefix 0 again: row 2's group
    ])
    computed = np.array([100, 64, 5, 200, 70, 0])
    c = grid_cascade(GRID, BS, table, computed)
    assert c.use and not c.reusable
    assert c.labels.tolist() == [0, 0, 1, 2, 3, 1]
    assert c.prefix_blocks.tolist() == [4, 0, 12, 4] and c.ref_rows.tolist() == [0, 2, 3, 4]
    assert not grid_cascade(GRID, BS, table[[2, 5]], computed[[2, 5]]).use  # nobody past the line


def test_a_query_that_crosses_a_line_is_refused_before_the_planner_changes():
    check_grid(GRID, ["a", "b"], np.array([0, 60]), np.array([64, 4]))  # ends at 63 and at 63
    with pytest.raises(InvalidRequestError, match="'b'.*positions 60..64.*grid line at 64"):
        check_grid(GRID, ["a", "b"], np.array([0, 60]), np.array([64, 5]))
    p = Planner(num_blocks=64, block_size=BS, num_query_heads=4, num_kv_heads=4, cascade_grid=GRID)
    toks, other = list(range(100)), list(range(500, 570))
    p.plan([S("a", toks, 64)])
    before = snapshot(p)
    with pytest.raises(InvalidRequestError, match="'b'.*crosses"):
        p.plan([S("a", toks, 36), S("b", other, 70)])
    assert same_state(before, snapshot(p))
    plan = p.plan([S("a", toks, 36), S("b", other, 64)])
    assert plan.attn.use_cascade and plan.num_cascade_groups == 2  # a past the line, b below it
    assert sorted(plan.attn.prefix_kv_lens.tolist()) == [0, 64]


def test_planner_refuses_a_grid_off_the_blocks():
    from ray_attn.planner import PlannerConfigError

    with pytest.raises(PlannerConfigError, match="cascade_grid 72 is not a multiple of block_size 16"):
        Planner(num_blocks=8, block_size=BS, num_query_heads=4, num_kv_heads=4, cascade_grid=72)


def test_grid_room():
    assert grid_room(0, GRID) == 64 and grid_room(63, GRID) == 1 and grid_room(64, GRID) == 64
    assert grid_room(5, None) is None


def test_grid_plans_match_dense_attention_through_the_backend():
    """Prefill in chunks that stop at the lines (one a prefix-cache hit on another's blocks),
    then decode and 1 + k queries: every step's attention equals float64 dense attention, rows
    below the first line ride along in a group of prefix 0, and two requests past the same line
    over the same blocks share one group."""
    pytest.importorskip("torch")
    from tests.planner.test_cascade_numerics import H, VOCAB, Runner

    rng = np.random.default_rng(12)
    p = Planner(num_blocks=200, block_size=BS, num_query_heads=H, num_kv_heads=2, cascade_grid=GRID)
    run = Runner(p, 2)
    shared = rng.integers(0, VOCAB, 150).tolist()
    prompts = {"a": shared + rng.integers(0, VOCAB, 30).tolist(), "c": rng.integers(0, VOCAB, 20).tolist(),
               "b": shared + rng.integers(0, VOCAB, 12).tolist()}
    t, shared_group, c_beside = run.tokens, False, False
    for step in range(16):
        sched = []
        for r, prompt in prompts.items():
            if r == "b" and step < 4:
                continue  # admitted once a's prefix is in the cache
            if r not in t:
                t[r] = list(prompt)
            done = p.num_computed_tokens(r) if p.has_request(r) else p.num_cached_tokens(t[r])
            if done == len(t[r]):  # decoding: one token, or every 3rd step a 1 + 2 query
                t[r] += rng.integers(0, VOCAB, 3 if step % 3 == 0 else 1).tolist()
            sched.append(S(r, t[r], min(len(t[r]) - done, 40, grid_room(done, GRID))))
        plan = run.step(sched)
        if plan.attn.use_cascade:
            group = dict(zip(plan.req_ids, plan.cascade_group_ids.tolist()))
            shared_group |= "b" in group and group["a"] == group["b"]
            c_beside |= "c" in group
    assert run.cascaded >= 10 and shared_group and c_beside
    assert p.num_computed_tokens("c") < GRID  # c stayed below the first line


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_engine_in_the_mode_cascades_on_the_grid_and_speculation_keeps_its_tokens(method):
    """The engine's scheduler stops prefill chunks at the lines and the speculative decoder stops
    drafts before them (the planner would refuse a crossing query), prompts that share a prefix
    past a line cascade, and speculative greedy equals plain greedy."""
    from ray_attn.config import EngineConfig, ModelConfig, ParallelConfig
    from ray_attn.engine import LLMEngine, SamplingParams
    from ray_attn.runtime import InProcessExecutor

    model = ModelConfig.from_name("tiny")
    rng = np.random.default_rng(3)
    shared = rng.integers(0, model.vocab_size, 90).tolist()
    prompts = [shared + (rng.integers(0, model.vocab_size, n).tolist() * 3) for n in (7, 11, 13)]
    spec = (dict(method="ngram", num_speculative_tokens=5, prompt_lookup_min=2, prompt_lookup_max=4)
            if method == "ngram" else dict(method="draft_model", num_speculative_tokens=5,
                                            draft_model_config=model.model_dump()))
    outs, stats = {}, {}
    for name, extra in (("plain", {}), ("spec", dict(speculative_config=spec))):
        cfg = EngineConfig(model=model, cache=dict(num_blocks=96, block_size=BS), max_num_seqs=4,
                           max_num_batched_tokens=200, **extra,
                           parallel=ParallelConfig(device="cpu", batch_invariant=True,
                                                   batch_invariant_cascade_grid=GRID))
        engine = LLMEngine(cfg, InProcessExecutor(cfg))
        try:
            assert engine.planner.cascade_grid == GRID and engine.scheduler.cascade_grid == GRID
            outs[name] = [o.output_token_ids for o in engine.generate(
                prompts, SamplingParams(max_tokens=48, ignore_eos=True))]
            stats[name] = engine.stats.as_dict()
        finally:
            engine.shutdown()
    assert stats["plain"]["cascade_steps"] > 0 and stats["spec"]["cascade_steps"] > 0
    assert stats["spec"]["spec_num_accepted_tokens"] > 0
    assert outs["spec"] == outs["plain"]


def test_the_grid_is_on_only_in_the_mode_and_where_cascade_may_run():
    from ray_attn.config import EngineConfig, ModelConfig, ParallelConfig

    def grid(model="tiny", **par):
        return cascade_grid(EngineConfig(model=ModelConfig.from_name(model), parallel=ParallelConfig(**par)))

    assert grid() is None and grid(batch_invariant=True) == 1024
    assert grid(batch_invariant=True, batch_invariant_cascade_grid=0) is None
    assert cascade_grid(EngineConfig(enable_cascade=False, parallel=ParallelConfig(batch_invariant=True))) is None
    with pytest.raises(ValueError, match="batch_invariant_cascade_grid=40 is not a multiple of cache.block_size=16"):
        EngineConfig(parallel=ParallelConfig(batch_invariant=True, batch_invariant_cascade_grid=40))
