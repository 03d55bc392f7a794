"""What ``GET /health`` and Serve's ``check_health`` report of one replica, and why a poll of
/health never waits on the workers.

Two kinds of check:

- **local** ones read a few attributes -- the engine loop's thread is alive, the engine did not
  stop after repeated worker failures, no step has run past ``step_timeout_s`` -- and are made on
  every call.  They never take a lock the engine thread holds, so they answer while a step runs
  (or hangs).
- the **workers' ping** is a round trip to each rank actor.  ``check_health`` (Serve's probe,
  every ``health_check_period_s``) waits for a fresh one, as a replacement decision should.
  ``/health`` instead answers from the latest ping that finished, and starts a new one in the
  background when that is older than ``REFRESH_S``; at most one ping is in flight, shared by
  whoever asks meanwhile.  Only the first poll, before any ping has finished, waits for one.

Why: under a burst a /health waits its turn behind the burst in Serve's proxy and the
replica's event loops, as every route does (``scripts/hostile_burst.py`` polls ``/stats`` beside
it; docs/serving.md has the numbers).  Awaiting a ping added turns of its own -- the call out
to each rank and the answers back, each behind whatever the burst queued meanwhile -- and
tied /health to the ranks' actors answering.  The price: a worker that dies shows on the poll
after the one that started the ping that finds it (and the engine finds it on its next step
anyway).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable, Optional

REFRESH_S = 1.0  # a ping result older than this is replaced, in the background, on the next poll


@dataclass(frozen=True)
class Health:
    ok: bool
    workers: int  # ranks that answered (1 for an in-process engine)
    detail: Optional[str] = None  # why not ok


class ReplicaHealth:
    """The health of one replica's engine loop, engine and workers (``executor.workers``)."""

    def __init__(self, loop, engine, executor, step_timeout_s: float, ping_timeout_s: float,
                 refresh_s: float = REFRESH_S, clock: Callable[[], float] = time.monotonic):
        self.loop, self.engine, self.executor = loop, engine, executor
        self.step_timeout_s, self.ping_timeout_s, self.refresh_s = step_timeout_s, ping_timeout_s, refresh_s
        self.clock = clock
        self.last: Optional[tuple[float, Health]] = None  # (when the latest ping finished, what it found)
        self._inflight: Optional[asyncio.Task] = None
        self.pings = 0  # pings started (the tests count them)

    # -- local checks -------------------------------------------------------------------------
    def local(self) -> Optional[Health]:
        """The failure the local checks find, or None."""
        if not self.loop.alive:
            return Health(False, 0, self.loop._dead_reason())
        dead = getattr(self.engine, "dead", None)  # set once ranks failed too often to recover
        if dead:
            return Health(False, 0, f"engine stopped after repeated worker failures: {dead}")
        running = self.loop.current_step_s()
        if running > self.step_timeout_s:
            return Health(False, 0, f"engine step has run for {running:.0f}s (step_timeout_s="
                                    f"{self.step_timeout_s:.0f}); a rank is hung")
        return None

    def _pinged_workers(self) -> list:
        """The rank actors to ping; none in process, and none on a compiled graph (its actors
        run the graph's loop: a dead one surfaces on the next step, which the engine recovers
        from, or it ends the requests and sets ``engine.dead``)."""
        if getattr(self.executor, "compiled", False):
            return []
        return list(getattr(self.executor, "workers", None) or [])

    def _without_ping(self) -> Health:
        return Health(True, len(getattr(self.executor, "workers", None) or []) or 1)

    # -- the workers' ping --------------------------------------------------------------------
    async def _ping(self, workers: list) -> Health:
        # A plain async ping of each rank (workers take max_concurrency=2, so it does not queue
        # behind a step).  During an in-place rank restart it may fail once or twice: Serve
        # needs 3 failures in a row before it replaces the replica.
        try:
            ranks = await asyncio.wait_for(asyncio.gather(*[w.ping.remote() for w in workers]),
                                           self.ping_timeout_s)
        except asyncio.TimeoutError:
            return Health(False, 0, f"worker ping timed out after {self.ping_timeout_s}s")
        except Exception as e:  # noqa: BLE001 - a dead actor raises RayActorError and friends
            return Health(False, 0, f"worker ping failed: {type(e).__name__}: {e}")
        return Health(True, len(ranks))

    def _refresh(self, workers: list) -> asyncio.Task:
        """The ping in flight on this event loop, or a new one; its result becomes ``last``."""
        task = self._inflight
        if task is not None and not task.done() and task.get_loop() is asyncio.get_running_loop():
            return task
        self.pings += 1

        async def run() -> Health:
            h = await self._ping(workers)
            self.last = (self.clock(), h)
            return h

        self._inflight = task = asyncio.ensure_future(run())
        return task

    # -- the two askers -----------------------------------------------------------------------
    async def check(self) -> Health:
        """Serve's ``check_health``: the local checks, then a fresh ping (joining one in flight)."""
        bad = self.local()
        if bad is not None:
            return bad
        workers = self._pinged_workers()
        if not workers:
            return self._without_ping()
        return await asyncio.shield(self._refresh(workers))

    async def poll(self) -> Health:
        """``GET /health``: the local checks, then the latest ping's result, never waiting for a
        new one once any has finished (one is started when the latest is older than
        ``refresh_s``)."""
        bad = self.local()
        if bad is not None:
            return bad
        workers = self._pinged_workers()
        if not workers:
            return self._without_ping()
        last = self.last
        if last is None:  # none finished yet: the first poll waits for one
            return await asyncio.shield(self._refresh(workers))
        if self.clock() - last[0] > self.refresh_s:
            self._refresh(workers)
        return last[1]


__all__ = ["Health", "REFRESH_S", "ReplicaHealth"]
