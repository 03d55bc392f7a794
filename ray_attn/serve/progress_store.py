"""Where a stream's progress outlives the front replica that relays it.

A front replica (``ingress.py``) relays each stream and numbers its events (SSE ``id:`` lines).
If that replica dies -- its process killed, its node lost -- the client's connection is cut; it
reconnects, through any front replica, with the same ``X-Request-Id`` and ``Last-Event-ID``
(``relay.py``).  The replica that takes the reconnection must then know what the stream had
sent: this module keeps that, **outside every front replica**, in small detached actors, one
per node that runs a front (``ProgressStore``), each front writing every stream to two of them
(its own node's and the next node's, by node id) before it sends the events to the client.

Why detached actors, and not Ray's object store: an object belongs to the process that put it,
and is lost with that process (Ray's ownership model: an object whose owner died cannot be
read, even where copies of it remain) -- the very loss this must survive.  An actor that is not
detached dies with its creator too.  A detached actor lives until it is killed or its node is
lost, so two of them on two nodes keep a copy through the loss of any one node or front.

What a record holds (``StreamRecord``): the request id; a digest of the request (method, path,
body, ``Authorization``: a reconnection must be the same request, from the same key); every
event the client was sent, id line included, in order; the progress lines of those events
(``resume.py``: the token ids, finishes and usage sent, from which a new replica carries on);
the replicas that served it; whether it ended; and an **epoch**.  Writes are appends at a
position under an epoch: a front that takes a stream over (a reconnection) raises the epoch on
every store first, so a front still relaying the old connection can no longer append.

The log is written ahead of the send: the client never holds an event that no store has, so a
reconnection can always go on exactly after its ``Last-Event-ID`` -- the events after it that
the log has are sent from the log, and the rest come from a replica resumed where the log
ends.  Writes are group-committed: each store gets one call at a time carrying every stream's
pending appends, so the cost is a round trip per store per batch, not per event.

Records are dropped ``resume_window_s`` after their last write (finished or not).  A store
that no front has touched for ``IDLE_EXIT_S`` (its app deleted) and that holds nothing exits.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

log = logging.getLogger("ray.serve")

NAMESPACE = "ray_attn"
PREFIX = "ray_attn_progress:"
IDLE_EXIT_S = 120.0
COPIES = 2


def store_name(app: str, node_id: str) -> str:
    return f"{PREFIX}{app}:{node_id}"


def request_digest(method: str, path: str, body: bytes, authorization: bytes) -> str:
    h = hashlib.sha256()
    for part in (method.encode(), path.encode(), body, authorization):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


# ------------------------------------------------------------------------------------ the log
@dataclass
class StreamRecord:
    request_id: str
    epoch: int
    digest: str
    events: list = field(default_factory=list)    # bytes: each a whole SSE event with its id line
    progress: list = field(default_factory=list)  # bytes: the progress lines of those events
    replicas: list = field(default_factory=list)  # (LLMServer replica, its first event) per attempt
    done: bool = False
    updated: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "StreamRecord":
        return cls(**d)


@dataclass(frozen=True)
class Write:
    """Append ``events`` (and their ``progress`` lines) at position ``start`` of ``request_id``'s
    log, under ``epoch``; ``start`` 0 with a newer epoch replaces the record."""

    request_id: str
    epoch: int
    digest: str
    start: int
    events: tuple = ()
    progress_start: int = 0
    progress: tuple = ()
    replicas: tuple = ()
    done: bool = False


OK, STALE, GAP = "ok", "stale", "gap"


class ProgressLog:
    """The records of one store (plain Python: the actor below holds one)."""

    def __init__(self):
        self.records: dict[str, StreamRecord] = {}

    def write(self, w: Write, now: float) -> str:
        rec = self.records.get(w.request_id)
        if rec is not None and rec.epoch > w.epoch:
            return STALE  # taken over by a newer connection
        if rec is None or rec.epoch < w.epoch:
            if w.start != 0:
                return GAP  # this store lacks the beginning: the writer sends it all
            rec = self.records[w.request_id] = StreamRecord(w.request_id, w.epoch, w.digest)
        if w.start > len(rec.events) or w.progress_start > len(rec.progress):
            return GAP
        del rec.events[w.start:]
        rec.events += w.events
        del rec.progress[w.progress_start:]
        rec.progress += w.progress
        rec.replicas = list(w.replicas)
        rec.done = w.done
        rec.updated = now
        return OK

    def takeover(self, request_id: str, epoch: int) -> Optional[dict]:
        """The record (None if absent), which only writes of ``epoch`` or newer may change now."""
        rec = self.records.get(request_id)
        if rec is None:
            return None
        out = rec.to_dict()
        rec.epoch = max(rec.epoch, epoch)
        return out

    def prune(self, now: float, window_s: float) -> int:
        old = [k for k, r in self.records.items() if r.updated < now - window_s]
        for k in old:
            del self.records[k]
        return len(old)

    def stats(self) -> dict:
        return {"streams": len(self.records), "live": sum(not r.done for r in self.records.values()),
                "bytes": sum(len(e) for r in self.records.values() for e in r.events)}


def best(records: list[Optional[dict]]) -> Optional[StreamRecord]:
    """Of the copies found, the newest epoch's longest log."""
    found = [StreamRecord.from_dict(r) for r in records if r]
    return max(found, key=lambda r: (r.epoch, len(r.events), r.done), default=None)


# ---------------------------------------------------------------------------------- the actor
class ProgressStore:
    """One node's store (a detached Ray actor, ``ray.remote``'d in ``ProgressStores``)."""

    def __init__(self, window_s: float, idle_exit_s: float = IDLE_EXIT_S):
        self.log = ProgressLog()
        self.window_s, self.idle_exit_s = window_s, idle_exit_s
        self.touched = time.monotonic()
        self._pruner = None

    def _touch(self) -> None:
        self.touched = time.monotonic()
        if self._pruner is None:
            self._pruner = asyncio.get_running_loop().create_task(self._prune_loop())

    async def write_many(self, writes: list) -> list[str]:
        self._touch()
        now = time.monotonic()
        return [self.log.write(w, now) for w in writes]

    async def takeover(self, request_id: str, epoch: int) -> Optional[dict]:
        self._touch()
        return self.log.takeover(request_id, epoch)

    async def ping(self) -> dict:
        self._touch()
        return self.log.stats()

    async def _prune_loop(self) -> None:
        import ray

        while True:
            await asyncio.sleep(min(5.0, self.window_s / 2))
            self.log.prune(time.monotonic(), self.window_s)
            if not self.log.records and time.monotonic() - self.touched > self.idle_exit_s:
                log.info("progress store: no front for %.0fs; exiting", self.idle_exit_s)
                ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
                return


# --------------------------------------------------------------------------- the front's side
class _Batcher:
    """Group commit to one store: one call in flight, the next batch gathering meanwhile."""

    def __init__(self, name: str, handle):
        self.name, self.handle = name, handle
        self.pending: list[tuple[Write, asyncio.Future]] = []
        self.task: Optional[asyncio.Task] = None
        self.dead = False

    def submit(self, w: Write) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        if self.dead:
            fut.set_result(None)
            return fut
        self.pending.append((w, fut))
        if self.task is None or self.task.done():
            # In a context of its own: Ray cancels the calls a request made when the request is
            # cancelled (its client gone), and this task serves every stream, not one request.
            self.task = asyncio.get_running_loop().create_task(self._flush(), context=contextvars.Context())
        return fut

    async def _flush(self) -> None:
        from ray.exceptions import RayActorError

        while self.pending:
            batch, self.pending = self.pending, []
            try:
                results = await self.handle.write_many.remote([w for w, _ in batch])
            except RayActorError as e:  # the store (its node) is gone
                log.warning("progress store %s lost: %s: %s", self.name, type(e).__name__, e)
                self.dead = True
                results = [None] * len(batch)
            except Exception as e:  # noqa: BLE001 - this batch failed; the store may serve the next
                log.warning("progress store %s: a write failed: %s: %s", self.name, type(e).__name__, e)
                results = [None] * len(batch)
            for (_, fut), res in zip(batch, results):
                if not fut.done():
                    fut.set_result(res)


class ProgressStores:
    """A front replica's view of its app's stores: creates its node's, finds the others, writes
    each stream to ``COPIES`` of them and reads a stream back from all."""

    def __init__(self, app: str, node_id: str, window_s: float, write_timeout_s: float = 2.0):
        self.app, self.node_id, self.window_s = app, node_id, window_s
        self.write_timeout_s = write_timeout_s
        self.batchers: dict[str, _Batcher] = {}  # by node id
        self._refreshed = 0.0

    # -- finding them
    def _own(self):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        actor = ray.remote(ProgressStore).options(
            name=store_name(self.app, self.node_id), namespace=NAMESPACE, lifetime="detached",
            get_if_exists=True, num_cpus=0, max_restarts=0, max_concurrency=64,
            scheduling_strategy=NodeAffinitySchedulingStrategy(self.node_id, soft=False))
        return actor.remote(self.window_s)

    def start(self, timeout_s: float = 60.0) -> None:
        """Create this node's store now and wait for it, as the front replica starts: a store's
        worker takes a second or more to start, and the first stream would wait for it before
        its first event.  A store that does not come is left to the first write to retry."""
        import ray

        b = _Batcher(store_name(self.app, self.node_id), self._own())
        try:
            ray.get(b.handle.ping.remote(), timeout=timeout_s)
        except Exception as e:  # noqa: BLE001 - streams still go out; a reconnection would miss them
            log.warning("progress store on this node not up within %.0fs (%s: %s)", timeout_s, type(e).__name__, e)
            return
        self.batchers[self.node_id] = b

    async def refresh(self, force: bool = False) -> None:
        """Look the stores up again (every few seconds at most, unless ``force``)."""
        import ray

        if not force and time.monotonic() - self._refreshed < 5.0:
            return
        self._refreshed = time.monotonic()
        prefix = store_name(self.app, "")
        try:
            listed = await asyncio.to_thread(ray.util.list_named_actors, True)
        except Exception as e:  # noqa: BLE001 - the GCS away (its head restarting): keep the stores known
            log.warning("progress stores: cannot list them now (%s: %s)", type(e).__name__, e)
            return
        names = [a["name"] for a in listed if a.get("namespace") == NAMESPACE and a["name"].startswith(prefix)]
        found: dict[str, _Batcher] = {}
        for name in names:
            node = name[len(prefix):]
            b = self.batchers.get(node)
            if b is None or b.dead:
                try:
                    b = _Batcher(name, ray.get_actor(name, namespace=NAMESPACE))
                except ValueError:
                    continue  # gone since the listing
            found[node] = b
        own = found.get(self.node_id)
        if own is None or own.dead:
            found[self.node_id] = _Batcher(store_name(self.app, self.node_id), self._own())
        self.batchers = found

    def targets(self) -> list[_Batcher]:
        """This node's store and the next node's (by node id, wrapping): two nodes when there are."""
        alive = sorted(n for n, b in self.batchers.items() if not b.dead)
        if not alive:
            return []
        start = alive.index(self.node_id) if self.node_id in alive else 0
        return [self.batchers[alive[(start + k) % len(alive)]] for k in range(min(COPIES, len(alive)))]

    # -- writing and reading
    async def write(self, w: Write, full=None) -> int:
        """Append ``w`` to the stream's copies, ahead of the send: returns how many hold it.
        A store that lacks the log's beginning (a new target) is sent ``full`` instead.  Waits
        for every copy up to ``write_timeout_s``, then for one at least."""
        await self.refresh()
        targets = self.targets()
        if not targets:
            return 0
        futs = {b.submit(w): b for b in targets}
        done, pending = await asyncio.wait(futs, timeout=self.write_timeout_s)
        if not any(f.result() == OK for f in done) and pending:
            done2, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            done |= done2
        held = 0
        for f in done:
            res = f.result()
            if res == GAP and full is not None:
                res = await futs[f].submit(full() if callable(full) else full)
            if res == STALE:
                raise Superseded(w.request_id)
            held += res == OK
        return held

    async def takeover(self, request_id: str, epoch: int) -> Optional[StreamRecord]:
        """The stream's record from every store that has it (newest epoch, longest log); every
        copy refuses writes of older epochs from now on.  No record, but a store that did not
        answer (busy, or its node being lost): ``Unanswered`` -- the client may try again."""
        await self.refresh(force=True)
        calls = [b.handle.takeover.remote(request_id, epoch) for b in self.batchers.values() if not b.dead]
        results = await asyncio.gather(*[_bounded(c, self.write_timeout_s * 5, _MISSING) for c in calls])
        rec = best([r for r in results if r is not _MISSING])
        if rec is None and any(r is _MISSING for r in results):
            raise Unanswered(f"{sum(r is _MISSING for r in results)} of {len(results)} progress stores did not "
                             f"answer")
        return rec

    async def stats(self) -> dict:
        await self.refresh(force=True)
        out = {}
        for node, b in self.batchers.items():
            out[node] = await _bounded(b.handle.ping.remote(), self.write_timeout_s)
        return out


class Superseded(Exception):
    """A newer connection with the same request id has taken the stream over."""


class Unanswered(Exception):
    """No store had the stream, but one or more did not answer."""


_MISSING = object()


async def _bounded(ref, timeout: float, missing=None):
    try:
        return await asyncio.wait_for(ref, timeout)
    except Exception:  # noqa: BLE001 - a store lost, or too slow: the others answer
        return missing


def find(app: str, request_id: str, timeout: float = 10.0) -> Optional[StreamRecord]:
    """A stream's record, read from the driver (tests, tools); changes nothing (epoch 0)."""
    import ray

    prefix = store_name(app, "")
    refs = []
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a.get("namespace") == NAMESPACE and a["name"].startswith(prefix):
            try:
                refs.append(ray.get_actor(a["name"], namespace=NAMESPACE).takeover.remote(request_id, 0))
            except ValueError:
                pass
    out = []
    for r in refs:
        try:
            out.append(ray.get(r, timeout=timeout))
        except Exception:  # noqa: BLE001 - a store on a lost node
            pass
    return best(out)


__all__ = ["COPIES", "NAMESPACE", "ProgressLog", "ProgressStore", "ProgressStores", "StreamRecord",
           "Superseded", "Unanswered", "Write", "best", "find", "request_digest", "store_name"]
