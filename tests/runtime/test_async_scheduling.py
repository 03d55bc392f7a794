"""Async scheduling plans step N+1 before step N's tokens are back; it must change nothing a
request sees -- tokens, finish reasons, stop handling, preemption, prefix caching, TP, faults."""

from __future__ import annotations

import numpy as np
import pytest

from ray_attn.engine import LLMEngine, SamplingParams
from ray_attn.runtime import InProcessExecutor, StepInput
from tests.runtime.test_engine_tp import GREEDY, config, single_process_tokens, workload  # noqa: F401

pytestmark = pytest.mark.slow


def with_async(cfg, on=True):
    return cfg.model_copy(update={"async_scheduling": on})


def run(cfg, prompts, params, executor=None):
    eng = LLMEngine(cfg, executor or InProcessExecutor(cfg))
    outs = eng.generate(prompts, params)
    return eng, [(o.output_token_ids, o.finish_reason) for o in outs]


def seeded(n, max_tokens=10):
    return [SamplingParams(max_tokens=max_tokens, temperature=0.8 if i % 3 else 0.0,
                           seed=None if i % 3 else i) for i in range(n)]


def stop_params(ref_outs, max_tokens):
    """Stop tokens taken from the reference run itself, so that requests do stop mid-way."""
    params = []
    for i, (toks, _) in enumerate(ref_outs):
        stop = (toks[2 + i % 4],) if i % 2 == 0 and len(toks) > 6 else ()
        params.append(SamplingParams(max_tokens=max_tokens, stop_token_ids=stop))
    return params


@pytest.mark.parametrize("case", ["greedy", "seeded", "stop", "preempt", "samples"])
def test_async_equals_sync(case):
    prompts, params, blocks = workload(n=6), GREEDY, 256
    if case == "seeded":
        # Unseeded hot rows draw from the rank's generator: the same calls in the same order.
        params = [SamplingParams(max_tokens=10, temperature=0.8, seed=i) if i % 2 else
                  SamplingParams(max_tokens=10) for i in range(len(prompts))]
    if case == "preempt":
        blocks = 30  # far too small: requests are preempted (some while their token is out)
    if case == "samples":  # 4 samples of 3 prompts: shared blocks, cascade groups, prefix hits
        prompts = [p for p in workload(n=3)[:3] for _ in range(4)]
        params = [SamplingParams(max_tokens=12, temperature=1.0, seed=i) for i in range(len(prompts))]
    sync_cfg = config(num_blocks=blocks)
    if case == "stop":
        _, ref = run(sync_cfg, prompts, SamplingParams(max_tokens=16))
        params = stop_params(ref, 16)
    sync_eng, sync = run(sync_cfg, prompts, params)
    async_eng, asyn = run(with_async(sync_cfg), prompts, params)
    assert asyn == sync
    assert len({tuple(t) for t, _ in sync}) > 1
    if case == "stop":
        assert sum(r == "stop" for _, r in sync) >= 2
    if case == "preempt":
        assert async_eng.stats.preemptions > 0
    if case == "samples":
        assert async_eng.planner.stats()["prefix_cache_hits"] > 0
    # The same work was done, except the extra step after a stop token; nothing leaked.
    assert async_eng.stats.tokens_generated == sync_eng.stats.tokens_generated
    assert async_eng.planner.stats()["num_used_blocks"] == 0
    assert all(r.pending == 0 for r in async_eng.requests.values())


def test_unset_means_off_on_cpu():
    cfg = config()
    assert cfg.async_scheduling is None
    assert LLMEngine(cfg, InProcessExecutor(cfg)).async_scheduling is False


def test_outputs_arrive_one_step_late_and_flush_at_the_end():
    cfg = with_async(config())
    eng = LLMEngine(cfg, InProcessExecutor(cfg))
    rid = eng.add_request(workload()[0], SamplingParams(max_tokens=3))
    assert eng.step() == []  # the prefill's token is still on the rank
    assert eng.requests[rid].pending == 1 and eng.output(rid).output_token_ids == []
    got = []
    while eng.has_unfinished_requests():
        got += [o.new_token_ids[0] for o in eng.step()]
    out = eng.output(rid)
    assert got == out.output_token_ids and len(got) == 3 and out.finish_reason == "length"
    # 1 prefill + 2 decode steps were submitted; the last step() only flushed.
    assert eng.stats.steps == 3 and eng._step_id == 3


def test_stop_token_discards_the_token_already_scheduled():
    cfg = config()
    prompt = workload()[1]
    _, [(toks, _)] = run(cfg, [prompt], [SamplingParams(max_tokens=10)])
    params = SamplingParams(max_tokens=10, stop_token_ids=(toks[3],))
    cut = toks.index(toks[3]) + 1
    eng = LLMEngine(with_async(cfg), InProcessExecutor(with_async(cfg)))
    rid = eng.add_request(prompt, params)
    while eng.has_unfinished_requests():
        eng.step()
    out = eng.output(rid)
    assert out.output_token_ids == toks[:cut] and out.finish_reason == "stop"
    assert eng.requests[rid].token_ids == prompt + toks[:cut], "no placeholder is left behind"
    assert eng.planner.stats()["num_used_blocks"] == 0


def test_abort_while_a_token_is_out():
    cfg = with_async(config())
    eng = LLMEngine(cfg, InProcessExecutor(cfg))
    a = eng.add_request(workload()[0], SamplingParams(max_tokens=8))
    b = eng.add_request(workload()[2], SamplingParams(max_tokens=8))
    for _ in range(3):
        eng.step()
    eng.abort_request(a)
    assert eng.output(a).finish_reason == "abort" and eng.requests[a].pending == 0
    while eng.has_unfinished_requests():
        eng.step()
    _, [(ref, _)] = run(config(), [workload()[2]], [SamplingParams(max_tokens=8)])
    assert eng.output(b).output_token_ids == ref
    assert eng.planner.stats()["num_used_blocks"] == 0


def test_worker_protocol_checks():
    """A rank answers a deferred step with the previous one, refuses to drop an answer, and
    refuses a placeholder it cannot fill."""
    cfg = config()
    ex = InProcessExecutor(cfg)
    eng = LLMEngine(cfg, ex)
    from ray_attn.planner import ScheduledRequest

    plan = eng.planner.plan([ScheduledRequest("x", workload()[0])])
    B = plan.num_reqs

    def step(step_id, **kw):
        return StepInput(plan, np.zeros(B, np.float32), -np.ones(B, np.int64), np.zeros(B, np.int32),
                         step_id=step_id, **kw)

    w = ex.worker
    ph = plan.input_token_ids.copy()
    with pytest.raises(RuntimeError, match="has run no step"):
        w._run(step(0, prev_token_index=np.array([0], np.int32), prev_token_rows=np.array([0], np.int32)))
    assert w._run(step(1, defer=True)) is None
    with pytest.raises(RuntimeError, match="deferred step 1 was never collected"):
        w._run(step(2))
    first = w._run(StepInput.flush(3))
    assert first.step_id == 1 and first.token_ids.shape == (B,)
    assert w._run(StepInput.flush(4)) is None
    assert np.array_equal(plan.input_token_ids, ph)


def test_placeholder_blocks_are_never_indexed():
    """Two samples of one prompt, each with its unknown token filling a block in a step that also
    prefills: the planner must not hash (and so dedupe) those blocks onto each other."""
    from ray_attn.planner import Planner, ScheduledRequest

    bs = 16
    p = Planner(num_blocks=64, block_size=bs, num_query_heads=4, num_kv_heads=2)
    prompt = list(range(1, 2 * bs))  # 31 tokens: the 32nd (sampled) fills block 2
    a, b = prompt + [-1], prompt + [-1]
    p.plan([ScheduledRequest("a", a[:-1]), ScheduledRequest("b", b[:-1])])
    plan = p.plan([ScheduledRequest("a", a, 1), ScheduledRequest("b", b, 1),
                   ScheduledRequest("c", list(range(100, 140)))])  # mixed: the hashing path
    assert plan.input_token_ids[0] == -1 and plan.input_token_ids[1] == -1
    ta, tb = p.table.block_table[p._slot("a"), :2], p.table.block_table[p._slot("b"), :2]
    assert ta[0] == tb[0], "the full prompt block is shared"
    assert ta[1] != tb[1], "blocks holding different (unknown) tokens must stay apart"
    used = p.stats()["num_used_blocks"]
    a[-1], b[-1] = 7, 8  # the tokens come back, different
    p.free("a")
    p.free("b")
    assert p.num_cached_tokens(prompt + [7] + [0]) == 2 * bs  # hashed once the token is real
    assert p.num_cached_tokens(prompt + [9] + [0]) == bs
    assert used >= 3


@pytest.mark.parametrize("tp,compiled", [(2, False), (2, True)])
def test_async_over_ray_matches_single_process(ray_local, single_process_tokens, tp, compiled):
    eng = LLMEngine(with_async(config(tp, compiled)))
    try:
        outs = eng.generate(workload(), GREEDY)
        assert [o.output_token_ids for o in outs] == single_process_tokens
        params = seeded(4)
        ref = LLMEngine(config(), InProcessExecutor(config())).generate(workload(n=4)[:4], params)
        assert [o.output_token_ids for o in eng.generate(workload(n=4)[:4], params)] == \
            [o.output_token_ids for o in ref]
    finally:
        eng.shutdown()


def test_async_recovers_from_a_dead_rank(ray_local):
    from tests.runtime.test_faults import run_with_kills

    prompts = workload(n=4)
    reference = LLMEngine(config(), InProcessExecutor(config())).generate(prompts, GREEDY)
    engine = LLMEngine(with_async(config(2)))
    try:
        outs = run_with_kills(engine, prompts, GREEDY, kill_at_steps={4}, how="ray.kill", rank=1)
        assert engine.stats.recoveries == 1
        assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in reference]
        assert engine.planner.stats()["num_used_blocks"] == 0
    finally:
        engine.shutdown()


def test_flush_collects_without_scheduling_more_and_mode_can_switch():
    cfg = with_async(config())
    eng = LLMEngine(cfg, InProcessExecutor(cfg))
    rid = eng.add_request(workload()[0], SamplingParams(max_tokens=6))
    eng.step()
    eng.step()
    got = eng.flush()
    assert [o.request_id for o in got] == [rid] and eng.requests[rid].num_output_tokens == 2
    assert eng.flush() == [] and eng.stats.steps == 2, "flush runs no new step"
    eng.set_async_scheduling(False)
    while eng.has_unfinished_requests():
        eng.step()
    _, [(ref, _)] = run(config(), [workload()[0]], [SamplingParams(max_tokens=6)])
    assert eng.output(rid).output_token_ids == ref


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", ["auto", "off"])
def test_async_equals_sync_on_gpu(graphs):
    """On the GPU the rank fills the placeholders inside the stream, ahead of a replayed graph or
    an eager forward, and stages sampling without a sync: the tokens must not change."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    base = config(dtype="bfloat16")
    cfg = base.model_copy(update={"parallel": base.parallel.model_copy(
        update={"device": "cuda", "cuda_graphs": graphs})})
    prompts = [p for p in workload(n=6) for _ in range(2)]
    params = [SamplingParams(max_tokens=12, temperature=0.0 if i % 3 == 0 else 0.9, seed=i)
              for i in range(len(prompts))]
    sync_eng, sync = run(with_async(cfg, False), prompts, params)
    async_eng, asyn = run(cfg, prompts, params)
    assert async_eng.async_scheduling and not sync_eng.async_scheduling, "unset means on, on a GPU"
    assert asyn == sync and len({tuple(t) for t, _ in sync}) > 2
    assert (async_eng.executor.worker.graphs is not None) == (graphs == "auto")
    assert async_eng.planner.stats()["num_used_blocks"] == 0
