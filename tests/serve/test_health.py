"""``/health`` and ``check_health`` (``serve/health.py``) without Serve: the order of events
between a poll, the workers' ping and the engine loop, never how fast.

The property issue 37 asked for: a poll with a ping result on hand finishes without suspending
once -- it awaits no ping, no engine step and no lock -- so that under a burst it is not sent
round the replica's event loop again behind everything the burst queued.  Driving the poll
coroutine by hand (``send(None)``) shows that: a coroutine that awaits a pending future yields
instead of returning."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from ray_attn.serve.health import Health, ReplicaHealth
from tests.timescale import scaled, wait_for


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Worker:
    """A rank actor whose pings stay pending until the test answers them."""

    def __init__(self):
        self.pending: list[asyncio.Future] = []
        self.ping = SimpleNamespace(remote=self._remote)

    def _remote(self):
        f = asyncio.get_running_loop().create_future()
        self.pending.append(f)
        return f

    def answer(self, rank=0, error: Exception | None = None):
        for f in self.pending:
            if not f.done():
                f.set_exception(error) if error else f.set_result(rank)
        self.pending.clear()


class Loop:
    """The engine loop's side that the local checks read."""

    def __init__(self):
        self.alive, self.step_s = True, 0.0

    def current_step_s(self):
        return self.step_s

    def _dead_reason(self):
        return "engine loop failed: RuntimeError: boom"


def replica(n_workers=2, compiled=False, loop=None, step_timeout_s=120.0):
    workers = [Worker() for _ in range(n_workers)]
    executor = SimpleNamespace(workers=workers, compiled=compiled)
    clock = Clock()
    h = ReplicaHealth(loop or Loop(), SimpleNamespace(dead=None), executor, step_timeout_s=step_timeout_s,
                      ping_timeout_s=scaled(30), refresh_s=1.0, clock=clock)
    return h, workers, clock


def in_one_step(coro):
    """Run ``coro`` without letting it suspend: its result, or AssertionError if it awaited."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise AssertionError("it suspended: it awaited something")


async def settle():
    for _ in range(5):  # the ping task's steps after its futures resolved
        await asyncio.sleep(0)


def test_a_poll_with_a_result_on_hand_never_waits_for_the_ping():
    async def scenario():
        h, workers, clock = replica()
        first = asyncio.ensure_future(h.poll())  # nothing on hand yet: the first poll waits
        await settle()
        assert not first.done() and h.pings == 1
        for w in workers:
            w.answer()
        assert (await first).ok and (await first).workers == 2
        # fresh: answered from it, no new ping
        assert in_one_step(h.poll()).ok and h.pings == 1
        # older than refresh_s: answered from it all the same, and one ping started behind it
        clock.now += 5
        for _ in range(3):
            got = in_one_step(h.poll())
            assert got.ok and got.workers == 2
        await settle()
        assert h.pings == 1 + 1 and all(len(w.pending) == 1 for w in workers)
        # that ping finds a dead rank: the next poll says so, still without waiting
        workers[0].answer(error=RuntimeError("actor died"))
        workers[1].answer()
        await settle()
        got = in_one_step(h.poll())
        assert not got.ok and "worker ping failed: RuntimeError: actor died" in got.detail

    asyncio.run(scenario())


def test_pings_are_shared_and_check_health_waits_for_a_fresh_one():
    async def scenario():
        h, workers, clock = replica()
        polls = [asyncio.ensure_future(h.poll()) for _ in range(5)]
        check = asyncio.ensure_future(h.check())
        await settle()
        assert h.pings == 1 and all(len(w.pending) == 1 for w in workers)  # one ping for all six
        for w in workers:
            w.answer()
        assert all(got.ok for got in await asyncio.gather(*polls, check))
        # check_health does not take the result on hand: it waits for the next ping ...
        check = asyncio.ensure_future(h.check())
        await settle()
        assert h.pings == 2 and not check.done()
        assert in_one_step(h.poll()).ok  # ... while a poll answers from the last one
        for w in workers:
            w.answer(error=RuntimeError("gone"))
        assert not (await check).ok
        assert not in_one_step(h.poll()).ok  # and /health answers from what check_health found
        # a poll that leaves (client gone) does not cancel the ping the others wait on
        h2, workers2, _ = replica()
        leaver, stayer = asyncio.ensure_future(h2.poll()), asyncio.ensure_future(h2.poll())
        await settle()
        leaver.cancel()
        await settle()
        for w in workers2:
            w.answer()
        assert (await stayer).ok and h2.pings == 1

    asyncio.run(scenario())


@pytest.mark.parametrize("n_workers,compiled,want", [(0, False, 1), (2, True, 2)])
def test_no_ping_in_process_or_on_a_compiled_graph(n_workers, compiled, want):
    async def scenario():
        h, workers, _ = replica(n_workers, compiled)
        for ask in (h.poll, h.check):
            got = in_one_step(ask())
            assert got.ok and got.workers == want
        assert h.pings == 0

    asyncio.run(scenario())


def test_local_failures_are_reported_at_once_without_a_ping():
    async def scenario():
        for breaks, words in [(lambda h: setattr(h.loop, "alive", False), "engine loop failed"),
                              (lambda h: setattr(h.engine, "dead", "rank 1 died 3 times"), "repeated worker"),
                              (lambda h: setattr(h.loop, "step_s", 500.0), "step_timeout_s=120")]:
            h, _, _ = replica()
            breaks(h)
            for ask in (h.poll, h.check):
                got = in_one_step(ask())
                assert not got.ok and words in got.detail, got
            assert h.pings == 0

    asyncio.run(scenario())


def test_a_poll_answers_while_the_engine_loop_is_blocked_in_a_step():
    """A real engine loop whose step waits on a gate: a poll finishes in one step all the
    while, healthy until the step has run past step_timeout_s (here 0: at once)."""
    from ray_attn.engine import LLMEngine, SamplingParams
    from ray_attn.runtime import InProcessExecutor
    from ray_attn.serve.loop import EngineLoop
    from tests.serve.helpers import engine_config

    cfg = engine_config(tp=1)
    eng = LLMEngine(cfg, InProcessExecutor(cfg))
    loop = EngineLoop(eng, max_in_flight=4).start()
    gate, real_step = threading.Event(), eng.executor.step
    eng.executor.step = lambda step: (gate.wait(scaled(30)), real_step(step))[1]
    done = threading.Event()
    sink = SimpleNamespace(push=lambda ev: ev.finished and done.set())
    try:
        loop.submit([1, 2, 3], SamplingParams(max_tokens=1), sink)
        assert wait_for(lambda: loop.current_step_s() > 0, 10), "the step began"

        async def polls():
            patient, _, _ = replica(loop=loop)
            patient.last = (patient.clock(), Health(True, 2))  # a ping on hand
            strict, _, _ = replica(loop=loop, step_timeout_s=0.0)
            return in_one_step(patient.poll()), in_one_step(strict.poll())

        patient, strict = asyncio.run(polls())
        assert not gate.is_set() and loop.current_step_s() > 0  # still blocked
        assert patient.ok and not strict.ok and "a rank is hung" in strict.detail
    finally:
        gate.set()
        done.wait(scaled(30))
        loop.stop()
