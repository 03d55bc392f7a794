"""The engine thread: continuous batching of concurrent submissions, bounded admission, aborts.

In-process engine (TP=1, no Ray): these run in seconds."""

from __future__ import annotations

import threading
import time

import pytest

from ray_attn.engine import LLMEngine, SamplingParams
from ray_attn.runtime import InProcessExecutor
from ray_attn.serve.loop import EngineLoop, Event, LoopDead, QueueFull, drive_blocking
from tests.serve.helpers import direct_generate, engine_config, sampling_params, workload
from tests.timescale import scaled, wait_for


def settled(loop) -> dict:
    """The loop's stats once nothing is in flight and the step that ended the last request has
    published its snapshot: ``EngineLoop._step`` counts a request done before it publishes, so
    ``in_flight`` can read 0 a moment before that step's freed blocks show.  A leak still reads
    its blocks after the wait."""
    wait_for(lambda: not loop.stats()["in_flight"], 10, 0.02)
    wait_for(lambda: loop.stats()["kv_blocks_used"] == 0, 10, 0.02)
    return loop.stats()


def make_engine(**kw):
    cfg = engine_config(tp=1, **kw)
    return LLMEngine(cfg, InProcessExecutor(cfg))


@pytest.fixture(scope="module")
def reference():
    eng = make_engine(max_num_seqs=8)
    bodies = workload(8)
    return bodies, direct_generate(eng, bodies)


class Collect:
    def __init__(self):
        self.events: list[Event] = []
        self.done = threading.Event()

    def push(self, ev):
        self.events.append(ev)
        if ev.kind in ("rejected", "failed") or ev.finished:
            self.done.set()

    @property
    def tokens(self):
        return [t for e in self.events for t in e.token_ids]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_concurrent_submissions_share_steps_and_match_generate(reference, async_scheduling):
    """Also with async scheduling, where outputs arrive a step late: nothing else changes."""
    bodies, want = reference
    eng = make_engine(max_num_seqs=8)
    eng.set_async_scheduling(async_scheduling)
    loop = EngineLoop(eng, max_in_flight=16).start()
    try:
        got = drive_blocking(loop, [b["prompt_token_ids"] for b in bodies],
                             [sampling_params(b) for b in bodies], timeout_s=60)
        assert got == want
        st = settled(loop)
        # Continuous batching: far fewer steps than tokens, several requests in one step.
        assert st["max_batch_size"] >= 4
        assert st["steps"] < st["tokens_generated"]
        assert st["in_flight"] == 0 and st["kv_blocks_used"] == 0
        assert st["requests_finished"] == len(bodies)
    finally:
        loop.stop()


def test_submissions_from_many_threads(reference):
    bodies, want = reference
    loop = EngineLoop(make_engine(max_num_seqs=8), max_in_flight=16).start()
    sinks = [Collect() for _ in bodies]
    try:
        threads = [threading.Thread(target=loop.submit, args=(b["prompt_token_ids"], sampling_params(b), s))
                   for b, s in zip(bodies, sinks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(s.done.wait(scaled(60)) for s in sinks)
        assert [s.tokens for s in sinks] == want
        assert all(s.events[0].kind == "accepted" and s.events[-1].finish_reason == "length" for s in sinks)
    finally:
        loop.stop()


def test_admission_is_bounded_and_frees_capacity():
    loop = EngineLoop(make_engine(max_num_seqs=2), max_in_flight=3).start()
    try:
        sinks = [Collect() for _ in range(3)]
        for s in sinks:
            loop.submit([1, 2, 3], SamplingParams(max_tokens=40), s)
        with pytest.raises(QueueFull, match="limit 3"):
            loop.submit([1, 2, 3], SamplingParams(max_tokens=4), Collect())
        assert loop.stats()["requests_rejected_full"] == 1
        assert all(s.done.wait(scaled(60)) for s in sinks)
        assert all(len(s.tokens) == 40 for s in sinks)
        late = Collect()
        loop.submit([4, 5], SamplingParams(max_tokens=3), late)  # room again
        assert late.done.wait(scaled(30)) and len(late.tokens) == 3
    finally:
        loop.stop()


def test_abort_frees_blocks_and_leaves_others_alone(reference):
    bodies, want = reference
    loop = EngineLoop(make_engine(max_num_seqs=8), max_in_flight=16).start()
    try:
        victim = Collect()
        rid = loop.submit(list(range(1, 60)), SamplingParams(max_tokens=200), victim)
        wait_for(lambda: len(victim.tokens) >= 2, 30, 0.01)
        others = [Collect() for _ in bodies]
        for b, s in zip(bodies, others):
            loop.submit(b["prompt_token_ids"], sampling_params(b), s)
        loop.abort(rid)
        assert victim.done.wait(scaled(30))
        assert victim.events[-1].finish_reason == "abort"
        assert all(s.done.wait(scaled(60)) for s in others)
        assert [s.tokens for s in others] == want
        st = settled(loop)
        assert st["in_flight"] == 0 and st["kv_blocks_used"] == 0
    finally:
        loop.stop()


def test_engine_rejection_reaches_only_that_request():
    eng = make_engine()
    loop = EngineLoop(eng, max_in_flight=8).start()
    try:
        bad, good = Collect(), Collect()
        loop.submit([1, 2, 10**6], SamplingParams(max_tokens=2), bad)  # outside the vocabulary
        loop.submit([1, 2, 3], SamplingParams(max_tokens=2), good)
        assert bad.done.wait(scaled(10)) and good.done.wait(scaled(30))
        assert bad.events[0].kind == "rejected" and "1000000" in bad.events[0].error
        assert len(good.tokens) == 2
        assert loop.stats()["in_flight"] == 0
    finally:
        loop.stop()


def test_failed_step_ends_requests_with_error_and_marks_loop_dead():
    eng = make_engine()
    loop = EngineLoop(eng, max_in_flight=8).start()
    try:
        real_step = eng.executor.step
        calls = {"n": 0}

        def flaky(step):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("rank 1 died")
            return real_step(step)

        eng.executor.step = flaky
        s = Collect()
        loop.submit([1, 2, 3], SamplingParams(max_tokens=10), s)
        assert s.done.wait(scaled(30))
        assert s.events[-1].finish_reason == "error" and "rank 1 died" in s.events[-1].error
        wait_for(lambda: not loop.alive, 5, 0.01)
        assert not loop.alive and not loop.stats()["engine_alive"]
        with pytest.raises(LoopDead, match="rank 1 died"):
            loop.submit([1], SamplingParams(max_tokens=1), Collect())
    finally:
        loop.stop()


def test_unexpected_add_error_fails_that_request_only():
    eng = make_engine()
    loop = EngineLoop(eng, max_in_flight=8).start()
    try:
        real_add = eng.add_request

        def add(prompt, params, request_id=None, **kw):
            if prompt == [9, 9, 9]:
                raise KeyError("boom")
            return real_add(prompt, params, request_id=request_id, **kw)

        eng.add_request = add
        bad, good = Collect(), Collect()
        loop.submit([9, 9, 9], SamplingParams(max_tokens=2), bad)
        loop.submit([1, 2, 3], SamplingParams(max_tokens=2), good)
        assert bad.done.wait(scaled(10)) and good.done.wait(scaled(30))
        assert bad.events[0].kind == "failed" and "KeyError" in bad.events[0].error
        assert len(good.tokens) == 2 and loop.alive
    finally:
        loop.stop()


def test_a_long_step_is_visible_to_the_health_check():
    eng = make_engine()
    loop = EngineLoop(eng, max_in_flight=8).start()
    try:
        real_step = eng.executor.step
        gate = threading.Event()

        def slow(step):
            gate.wait(scaled(10))
            return real_step(step)

        eng.executor.step = slow
        s = Collect()
        loop.submit([1, 2, 3], SamplingParams(max_tokens=1), s)
        time.sleep(0.5)
        assert loop.current_step_s() >= 0.3  # what check_health compares with step_timeout_s
        gate.set()
        assert s.done.wait(scaled(10))
        assert loop.current_step_s() == 0.0
    finally:
        loop.stop()
