"""A dead rank mid-generation: the cluster restarts its ranks in their bundles, the engine
recomputes the KV cache from its token history, and every request finishes with the tokens of a
run with no fault.  A rank that keeps dying ends the requests with a clear error."""

from __future__ import annotations

import os
import signal

import pytest
import ray

from ray_attn.engine import EngineDeadError, LLMEngine, SamplingParams
from ray_attn.runtime import InProcessExecutor, WorkerFailure
from tests.runtime.test_engine_tp import GREEDY, config, workload
from tests.timescale import scaled

pytestmark = pytest.mark.slow


def run_with_kills(engine, prompts, params, kill_at_steps, how, rank=1):
    ids = [engine.add_request(p, params) for p in prompts]
    step = 0
    while engine.has_unfinished_requests():
        if step in kill_at_steps:
            victim = engine.executor.workers[rank]
            if how == "ray.kill":
                ray.kill(victim)
            else:  # the worker process exits under it
                pid = ray.get(victim.device_info.remote())["pid"]
                os.kill(pid, signal.SIGKILL)
        engine.step()
        step += 1
    return [engine.output(i) for i in ids]


@pytest.mark.parametrize("tp,how,compiled", [(2, "ray.kill", False), (2, "process exit", False),
                                             (2, "ray.kill", True), (4, "ray.kill", False)])
def test_dead_rank_recovers_with_identical_tokens(ray_local, record_recovery, tp, how, compiled):
    prompts = workload(n=4)
    cfg = config()
    reference = LLMEngine(cfg, InProcessExecutor(cfg)).generate(prompts, GREEDY)
    engine = LLMEngine(config(tp, compiled))
    try:
        outs = run_with_kills(engine, prompts, GREEDY, kill_at_steps={4}, how=how, rank=tp - 1)
        assert engine.stats.recoveries == 1
        record_recovery(engine.stats.last_recovery_s)
        assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in reference]
        assert all(o.finish_reason == "length" for o in outs)
        assert engine.planner.stats()["num_used_blocks"] == 0
        assert engine.executor.call_all("ping") == list(range(tp))
    finally:
        engine.shutdown()


def test_rank_that_keeps_dying_ends_requests_with_error(ray_local):
    engine = LLMEngine(config(2))
    try:
        engine.executor.check_health(timeout=scaled(30))  # both ranks answer
        outs = run_with_kills(engine, workload(n=3), SamplingParams(max_tokens=40),
                              kill_at_steps={2, 3, 4}, how="ray.kill")
        with pytest.raises(WorkerFailure, match="rank 1 failed"):
            engine.executor.check_health(timeout=scaled(30))  # the third kill was not recovered
        assert engine.stats.recoveries == 2
        assert all(o.finish_reason == "error" for o in outs)
        assert all("3 worker failures within a minute" in o.error for o in outs)
        with pytest.raises(EngineDeadError, match="repeated worker failures"):
            engine.add_request([1, 2, 3])
    finally:
        engine.shutdown()


class FlakyExecutor(InProcessExecutor):
    """One process, no Ray: the next step after ``fail_next = True`` raises as a dead rank's does,
    and ``recover`` has nothing to restart."""

    fail_next = False

    def step(self, step):
        if self.fail_next:
            self.fail_next = False
            raise WorkerFailure(0, RuntimeError("injected"))
        return super().step(step)

    def recover(self) -> float:
        return 0.0


def test_recovered_requests_keep_their_order_ahead_of_the_queue():
    """After a failure the running requests are recomputed first, in the order they ran, and the
    requests that were waiting stay behind them in theirs."""
    cfg = config().model_copy(update={"max_num_seqs": 3})  # 3 run, 2 wait
    prompts = workload(n=5)[:5]
    reference = LLMEngine(cfg, InProcessExecutor(cfg)).generate(prompts, GREEDY)
    engine = LLMEngine(cfg, FlakyExecutor(cfg))
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    for _ in range(3):
        engine.step()
    running, waiting = [r.request_id for r in engine.running], [r.request_id for r in engine.waiting]
    assert running == ids[:3] and waiting == ids[3:]
    engine.executor.fail_next = True
    assert engine.step() == [] and engine.stats.recoveries == 1
    assert [r.request_id for r in engine.waiting] == running + waiting
    while engine.has_unfinished_requests():
        engine.step()
    assert [engine.output(i).output_token_ids for i in ids] == [o.output_token_ids for o in reference]
