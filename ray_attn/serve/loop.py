"""The thread that owns the engine: it batches every request in flight into the same engine steps.

``LLMEngine`` is not thread-safe, so exactly one thread touches it.  HTTP handlers (on the replica's
asyncio loop) talk to that thread through a command inbox (add, abort) and get their tokens back
through a per-request sink.  Each turn of the loop first takes *all* queued commands, then runs one
engine step for everything running -- continuous batching, never one step per request.

Admission is bounded: at most ``max_in_flight`` requests are accepted and unfinished at once;
one more raises :class:`QueueFull` at once (the app answers 503 with Retry-After), so memory does not
grow with the offered load.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

log = logging.getLogger(__name__)
# The adapter (a ray_attn.lora.LoRARequest) of the request being submitted: its handler resolves
# it (serve/lora_adapters.py) and ``submit``, called in the handler's context, reads it.
current_lora: contextvars.ContextVar = contextvars.ContextVar("ray_attn_lora", default=None)


class QueueFull(Exception):
    """The replica already holds ``max_in_flight`` requests."""


class LoopDead(Exception):
    """The engine loop has stopped (a failed step, or shutdown); the replica must be replaced."""


@dataclass
class Event:
    """What the loop tells a request's handler."""

    kind: str  # "accepted" | "rejected" (bad request) | "failed" (server side) | "tokens"
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    logprobs: Optional[list] = None  # TokenLogprobs per token_ids entry, when the request asked
    num_cached_tokens: int = 0  # its prompt tokens that were prefix-cache hits
    prompt_logprobs: Optional[list] = None  # on the first token's event, when the request asked


class Sink(Protocol):
    def push(self, event: Event) -> None: ...


class AsyncioSink:
    """Hands events from the engine thread to a coroutine on ``loop`` (thread-safe ``push``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None):
        self.loop = loop or asyncio.get_running_loop()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()

    def push(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the handler's loop is closed: nobody is listening any more
            pass

    async def get(self) -> Event:
        return await self.queue.get()


class LoopHooks:
    """Metric callbacks, run on the engine thread.  The Serve app plugs Ray metrics in here."""

    def on_step(self, latency_s: float, num_tokens: int, batch_size: int) -> None: ...

    def on_snapshot(self, snapshot: dict) -> None: ...

    def on_request_done(self, finish_reason: str) -> None: ...


class EngineLoop:
    def __init__(self, engine, max_in_flight: int, hooks: LoopHooks | None = None,
                 rate_window_s: float = 10.0, idle_wait_s: float = 0.25,
                 request_id_prefix: str = "req"):
        self.engine = engine
        self.max_in_flight = max_in_flight
        self.hooks = hooks or LoopHooks()
        self.rate_window_s = rate_window_s
        self.idle_wait_s = idle_wait_s
        self._prefix = request_id_prefix
        self._ids = itertools.count()
        self._inbox: deque[tuple] = deque()  # append/popleft are atomic
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards the counters below
        self._in_flight = 0
        self._pending_adds = 0
        self._rejected_full = 0
        self._finished = 0
        self._reasons: dict[str, int] = {}
        self._streams: dict[str, Sink] = {}  # engine thread only
        self._max_batch = 0
        self._rates: deque[tuple[float, int, int]] = deque()
        self._started = time.monotonic()
        self.error: BaseException | None = None
        self._step_started: float | None = None
        self._snapshot: dict = {}
        self._thread = threading.Thread(target=self._run, name="ray_attn-engine-loop", daemon=True)

    # -- any thread ---------------------------------------------------------------------------
    def start(self) -> "EngineLoop":
        self._publish()
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None and not self._stop.is_set()

    def submit(self, prompt_token_ids: Sequence[int], params, sink: Sink, output_token_ids: Sequence[int] = (),
               request_id: str | None = None) -> str:
        """Queue a request; its events go to ``sink``.  Raises QueueFull or LoopDead at once.
        ``output_token_ids``: the outputs so far of a request resumed from a lost replica
        (``LLMEngine.add_request``).  The engine's id is ``<request_id>-<n>`` (the HTTP
        request's id, ``serve/request_log.py``), else ``<request_id_prefix>-<n>``: n is unique
        in this loop, so two HTTP requests with one id never collide."""
        if not self.alive:
            raise LoopDead(self._dead_reason())
        with self._lock:
            if self._in_flight >= self.max_in_flight:
                self._rejected_full += 1
                raise QueueFull(f"{self._in_flight} requests in flight (limit {self.max_in_flight})")
            self._in_flight += 1
            self._pending_adds += 1
            rid = f"{request_id or self._prefix}-{next(self._ids)}"
        # the request's adapter, resolved by its handler (serve/lora_adapters.py)
        self._inbox.append(("add", rid, list(prompt_token_ids), params, sink, list(output_token_ids),
                            current_lora.get()))
        self._wake.set()
        return rid

    def call(self, fn) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the engine thread between steps (what must not race a step:
        unloading an adapter); its result or exception lands in the future returned."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.append(("call", fn, fut))
        self._wake.set()
        return fut

    def abort(self, request_id: str) -> None:
        """Stop a request whose client went away; a no-op once it has finished."""
        self._inbox.append(("abort", request_id))
        self._wake.set()

    def stats(self) -> dict:
        """The latest snapshot (taken on the engine thread after each step); never touches the engine."""
        snap = dict(self._snapshot)
        with self._lock:
            snap.update(in_flight=self._in_flight, requests_rejected_full=self._rejected_full,
                        requests_finished=self._finished,
                        requests_by_finish_reason=dict(self._reasons))
            snap["queue_depth"] = snap.get("engine_waiting", 0) + self._pending_adds
        snap["engine_alive"] = self.alive
        snap["max_in_flight"] = self.max_in_flight
        return snap

    def current_step_s(self) -> float:
        """How long the step in progress has run (0 when none is): a hung step shows here."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _dead_reason(self) -> str:
        if self.error is not None:
            return f"engine loop failed: {type(self.error).__name__}: {self.error}"
        return "engine loop is stopped"

    # -- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain()
                if self.engine.has_unfinished_requests():
                    self._step()
                else:
                    self._publish()
                    self._wake.wait(self.idle_wait_s)
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 - any failure ends the loop; health check reports it
            log.exception("engine loop failed")
            self.error = e
        finally:
            reason = self._dead_reason() if self.error else "server shutting down"
            self._fail_all(reason)
            self._publish()

    def _drain(self) -> None:
        while self._inbox:
            cmd = self._inbox.popleft()
            if cmd[0] == "add":
                _, rid, prompt, params, sink, resumed, lora = cmd
                with self._lock:
                    self._pending_adds -= 1
                try:
                    self.engine.add_request(prompt, params, request_id=rid, output_token_ids=resumed,
                                            **({"lora_request": lora} if lora is not None else {}))
                except Exception as e:  # noqa: BLE001 - one bad request must not end the loop
                    with self._lock:
                        self._in_flight -= 1
                    kind = "rejected" if isinstance(e, ValueError) else "failed"
                    sink.push(Event(kind, error=str(e) if kind == "rejected" else f"{type(e).__name__}: {e}"))
                    continue
                self._streams[rid] = sink
                sink.push(Event("accepted"))
            elif cmd[0] == "call":
                _, fn, fut = cmd
                try:
                    fut.set_result(fn(self.engine))
                except Exception as e:  # noqa: BLE001 -- the caller's to answer
                    fut.set_exception(e)
            elif cmd[0] == "abort":
                rid = cmd[1]
                if rid in self._streams:
                    self.engine.abort_request(rid)
                    self._done(rid, "abort", None)

    def _step(self) -> None:
        t0 = time.perf_counter()
        self._step_started = time.monotonic()
        outs = self.engine.step()
        self._step_started = None
        dt = time.perf_counter() - t0
        self._max_batch = max(self._max_batch, len(outs))
        for o in outs:
            sink = self._streams.get(o.request_id)
            if sink is None:
                continue
            sink.push(Event("tokens", list(o.new_token_ids), o.finished, o.finish_reason,
                            getattr(o, "error", None), getattr(o, "new_logprobs", None),
                            getattr(o, "num_cached_tokens", 0), getattr(o, "prompt_logprobs", None)))
            if o.finished:
                self._done(o.request_id, o.finish_reason, None, notify=False)
        # Requests the engine ended without an output this step (an abort, an error it raised
        # for one request): tell their handlers too.
        for rid in [r for r in self._streams if self._finished_in_engine(r)]:
            req = self.engine.requests.get(rid)
            self._done(rid, getattr(req, "finish_reason", None) or "error",
                       getattr(req, "error", None) or ("request lost by the engine" if req is None else None))
        self.hooks.on_step(dt, len(outs), len(outs))
        self._publish()

    def _finished_in_engine(self, rid: str) -> bool:
        req = self.engine.requests.get(rid)
        return req is None or req.finished

    def _done(self, rid: str, reason: str | None, error: str | None, notify: bool = True) -> None:
        sink = self._streams.pop(rid, None)
        if sink is None:
            return
        if notify:
            sink.push(Event("tokens", [], True, reason, error))
        self.engine.release(rid)
        with self._lock:
            self._in_flight -= 1
            self._finished += 1
            self._reasons[reason or "error"] = self._reasons.get(reason or "error", 0) + 1
        self.hooks.on_request_done(reason or "error")

    def _fail_all(self, reason: str) -> None:
        for sink in list(self._streams.values()):
            sink.push(Event("tokens", [], True, "error", reason))
        with self._lock:
            self._in_flight -= len(self._streams)
            self._finished += len(self._streams)
            self._reasons["error"] = self._reasons.get("error", 0) + len(self._streams)
        self._streams.clear()
        while self._inbox:
            cmd = self._inbox.popleft()
            if cmd[0] == "add":
                with self._lock:
                    self._pending_adds -= 1
                    self._in_flight -= 1
                cmd[4].push(Event("failed", error=reason))
            elif cmd[0] == "call":
                cmd[2].set_exception(RuntimeError(reason))

    def _publish(self) -> None:
        eng = self.engine
        now = time.monotonic()
        st = eng.stats
        self._rates.append((now, st.steps, st.tokens_generated))
        while len(self._rates) > 2 and now - self._rates[1][0] >= self.rate_window_s:
            self._rates.popleft()
        t_old, s_old, k_old = self._rates[0]
        span = now - t_old
        ps = eng.planner.stats()
        total = ps["num_free_blocks"] + ps["num_used_blocks"]
        q = ps["prefix_cache_queries"]
        snap = {
            "kv_blocks_total": total,
            "kv_blocks_used": ps["num_used_blocks"],
            "kv_blocks_free": ps["num_free_blocks"],
            "kv_blocks_cached": ps.get("num_cached_blocks", 0),
            "kv_usage": ps["num_used_blocks"] / total if total else 0.0,
            "prefix_cache_hits": ps["prefix_cache_hits"],
            "prefix_cache_queries": q,
            "prefix_cache_hit_rate": ps["prefix_cache_hits"] / q if q else 0.0,
            "cascade_rate": st.cascade_steps / st.steps if st.steps else 0.0,
            "local_rate": st.local_steps / st.steps if st.steps else 0.0,
            "steps": st.steps,
            "tokens_generated": st.tokens_generated,
            "steps_per_s": (st.steps - s_old) / span if span > 0 else 0.0,
            "tokens_per_s": (st.tokens_generated - k_old) / span if span > 0 else 0.0,
            "window_s": span,
            "max_batch_size": self._max_batch,
            "preemptions": st.preemptions,
            "recoveries": getattr(st, "recoveries", 0),
            "last_recovery_s": getattr(st, "last_recovery_s", None),
            "engine_dead": getattr(eng, "dead", None),
            "running": len(eng.running),
            "engine_waiting": len(eng.waiting),
            "uptime_s": now - self._started,
        }
        if "host_hit_blocks" in ps:
            snap.update(kv_tier_stats(ps, eng))
        snap.update(spec_decode_stats(st))
        self._snapshot = snap
        self.hooks.on_snapshot(self.stats())


def kv_tier_stats(ps: dict, eng) -> dict:
    """Hits per KV tier (tokens), bytes moved each way, and rank 0's copy time (planner/tiers.py)."""
    bs = eng.config.cache.block_size
    infos = getattr(eng.executor, "infos", None) or [{}]
    block_bytes = infos[0].get("kv_block_bytes") or 0  # one rank's shard of a block, all layers
    tiered = (ps["host_hit_blocks"] + ps["shared_hit_blocks"]) * bs
    return {
        "kv_hit_tokens_device": ps["prefix_cache_hits"] - tiered,
        "kv_hit_tokens_host": ps["host_hit_blocks"] * bs,
        "kv_hit_tokens_shared": ps["shared_hit_blocks"] * bs,
        "kv_offload_bytes": ps["offloaded_blocks"] * block_bytes,
        "kv_onload_bytes": ps["onloaded_blocks"] * block_bytes,
        "kv_publish_bytes": ps["published_blocks"] * block_bytes,
        "kv_fetch_bytes": ps["fetched_blocks"] * block_bytes,
        "kv_copy_s": eng.stats.kv_copy_s,
        "host_tier_blocks": ps["host_tier_blocks"],
    }


def spec_decode_stats(st) -> dict:
    """Speculative decoding's running totals (vLLM's SpecDecodingStats; zeros without speculation):
    rows that verified drafts, draft tokens, accepted ones in all and by draft position, and the
    mean acceptance length (tokens a speculating row emitted per step)."""
    return {
        "spec_decode_num_drafts": st.spec_num_drafts,
        "spec_decode_num_draft_tokens": st.spec_num_draft_tokens,
        "spec_decode_num_accepted_tokens": st.spec_num_accepted_tokens,
        "spec_decode_num_accepted_tokens_per_pos": list(st.spec_num_accepted_tokens_per_pos),
        "spec_decode_mean_acceptance_length": st.spec_mean_acceptance_length,
    }


def drive_blocking(loop: EngineLoop, prompts: Sequence[Sequence[int]], params,
                   timeout_s: float = 300.0) -> list[list[int]]:
    """Submit ``prompts`` to a running loop and wait for their tokens (tests and scripts)."""

    class _Collect:
        def __init__(self):
            self.events: list[Event] = []
            self.done = threading.Event()

        def push(self, ev: Event) -> None:
            self.events.append(ev)
            if ev.kind in ("rejected", "failed") or ev.finished:
                self.done.set()

    params = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
    sinks = []
    for p, sp in zip(prompts, params):
        s = _Collect()
        loop.submit(p, sp, s)
        sinks.append(s)
    deadline = time.monotonic() + timeout_s
    for s in sinks:
        if not s.done.wait(max(0.0, deadline - time.monotonic())):
            raise TimeoutError("requests did not finish in time")
    return [[t for e in s.events for t in e.token_ids] for s in sinks]


__all__ = ["AsyncioSink", "EngineLoop", "Event", "LoopDead", "LoopHooks", "QueueFull", "Sink",
           "drive_blocking"]
