"""What the server keeps of each request: its id, one log line when it ends, and -- with
``otlp_traces_endpoint`` -- its trace (``tracing.py``).

- **The id** is the client's ``X-Request-Id`` when it sends a usable one (1-128 visible ASCII
  characters), else a new one.  It is returned on every response, errors and 401s included, and
  the engine requests of the HTTP request are named after it (``<id>-<n>``, n counting this
  replica's engine requests: a client may send the same id twice, or ask for n > 1 choices).
  Behind the front (``ingress.py``) the front fixes the id in the forwarded headers, so every
  replica a resumed request runs on names its engine requests the same way.
  Serve's HTTP proxy already answers ``X-Request-ID`` with the id in the request's headers (the
  client's, or one it made and put there), so in a replica the app adds the header only when
  its id differs from that one (an id it refused); elsewhere it always does.
- **The log line** (``log_requests: summary``, the default) names the id, the client address,
  method, path, status, the tokens in and out (over its engine requests), prefix-cache hits,
  tokens carried over by a resume, and the time from the first byte in to the last byte out.
  Never the prompt or the output, unless ``log_requests: full``; nothing at all with ``off``.
  Never a header: keys travel in ``Authorization``.

The middleware is the app's outermost: a request refused by the key check or by admission
still gets its id and its line.  The engine loop is wrapped (:class:`ObservedLoop`) so that
what the handlers submit is counted where it happens, without the handlers knowing.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional

from ray_attn.serve.admission import client_host, route_path
from ray_attn.serve.http import server_error

log = logging.getLogger("ray.serve")
# A child of Serve's logger: in a replica its lines land in the replica's Serve log file.
request_log = logging.getLogger("ray.serve.ray_attn.requests")

REQUEST_ID_HEADER = b"x-request-id"
_ID = re.compile(rb"[\x21-\x7e]{1,128}")
MAX_LOGGED_CHARS = 4096  # of a prompt or an output, with log_requests: full


def request_id_of(scope) -> tuple[str, Optional[bytes]]:
    """The request's id and the ``X-Request-Id`` header it came from (None: made here)."""
    for k, v in scope.get("headers", ()):
        if k == REQUEST_ID_HEADER:
            return (v.decode("ascii"), v) if _ID.fullmatch(v) else (uuid.uuid4().hex, v)
    return uuid.uuid4().hex, None


def with_request_id(scope: dict, request_id: str) -> dict:
    """A copy of ``scope`` whose only ``X-Request-Id`` header is ``request_id``."""
    headers = [(k, v) for k, v in scope.get("headers", ()) if k != REQUEST_ID_HEADER]
    return dict(scope, headers=headers + [(REQUEST_ID_HEADER, request_id.encode())])


@dataclass(eq=False)
class RequestRecord:
    """One HTTP request as it goes.  The engine-side fields are written by the engine loop's
    thread (through :class:`RecordingSink`) and read once the response has ended."""

    request_id: str
    client: str
    method: str
    path: str
    started_ns: int = field(default_factory=time.time_ns)
    t0: float = field(default_factory=time.perf_counter)
    full: bool = False  # keep the body and the outputs (log_requests: full)
    traceparent: Optional[str] = None  # the client's W3C trace context, when tracing
    status: int = 0
    cancelled: bool = False  # the client went away (or the request was cancelled) first
    tokens_in: int = 0
    tokens_out: int = 0
    resumed_tokens: int = 0
    engine_ids: list[str] = field(default_factory=list)
    cached: dict[int, int] = field(default_factory=dict)  # engine request (by order) -> cached tokens
    outputs: dict[int, list[int]] = field(default_factory=dict)  # with full: the token ids
    body: bytearray = field(default_factory=bytearray)  # with full: the request body
    submitted_ns: Optional[int] = None  # first engine request handed to the loop
    accepted_ns: Optional[int] = None  # the engine took it in (the last one, with n > 1)
    first_token_ns: Optional[int] = None
    finished_ns: Optional[int] = None  # its last engine request ended
    ended_ns: Optional[int] = None  # the response's last byte went out

    @property
    def elapsed_ms(self) -> float:
        return 1e3 * (time.perf_counter() - self.t0)


_current: contextvars.ContextVar[Optional[RequestRecord]] = contextvars.ContextVar("ray_attn_request", default=None)


def current_request() -> Optional[RequestRecord]:
    """The record of the HTTP request this task serves (None outside one)."""
    return _current.get()


def current_request_id() -> str:
    """The id of the HTTP request this task serves; a fresh one outside any (a handler called
    directly, as the tests do)."""
    rec = _current.get()
    return rec.request_id if rec is not None else uuid.uuid4().hex


class RecordingSink:
    """A handler's sink with the record's counts taken on the way (on the engine thread)."""

    __slots__ = ("sink", "rec", "index")

    def __init__(self, sink, rec: RequestRecord, index: int):
        self.sink, self.rec, self.index = sink, rec, index

    def push(self, event) -> None:
        now, rec = time.time_ns(), self.rec
        if event.kind == "accepted":
            rec.accepted_ns = now
        elif event.kind == "tokens":
            if event.token_ids:
                rec.tokens_out += len(event.token_ids)
                if rec.first_token_ns is None:
                    rec.first_token_ns = now
                if rec.full:
                    rec.outputs.setdefault(self.index, []).extend(event.token_ids)
            if getattr(event, "num_cached_tokens", 0):
                rec.cached[self.index] = event.num_cached_tokens
            if event.finished:
                rec.finished_ns = now
        self.sink.push(event)


class ObservedLoop:
    """The engine loop as the handlers see it: ``submit`` names the engine request after the
    HTTP request's id and counts it in the request's record; the rest is the loop's own."""

    def __init__(self, loop):
        self.inner = loop

    def submit(self, prompt_token_ids, params, sink, output_token_ids=()) -> str:
        rec = _current.get()
        if rec is None:
            return self.inner.submit(prompt_token_ids, params, sink, output_token_ids)
        index = len(rec.engine_ids)
        if rec.submitted_ns is None:
            rec.submitted_ns = time.time_ns()
        rid = self.inner.submit(prompt_token_ids, params, RecordingSink(sink, rec, index), output_token_ids,
                                request_id=rec.request_id)
        rec.engine_ids.append(rid)
        rec.tokens_in += len(prompt_token_ids)
        rec.resumed_tokens += len(output_token_ids)
        return rid

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _shown(text: str, limit: int = 200) -> str:
    """``text`` for a log line: printable, bounded."""
    return text[:limit].encode("unicode_escape").decode("ascii")


def log_line(rec: RequestRecord, extra: str = "") -> None:
    """A finished request's one line (``RequestLog.finish``, and Serve's proxy for the requests it
    refuses itself: ``proxy_auth.py``)."""
    request_log.info("request %s client=%s %s %s status=%d%s tokens_in=%d tokens_out=%d cached=%d "
                     "resumed=%d time_ms=%.1f%s", rec.request_id, rec.client, rec.method, _shown(rec.path),
                     rec.status, " cancelled" if rec.cancelled else "", rec.tokens_in, rec.tokens_out,
                     sum(rec.cached.values()), rec.resumed_tokens, rec.elapsed_ms, extra)


class RequestLog:
    """One replica's request log and tracing; ``mode`` is ``log_requests``."""

    def __init__(self, mode: str = "summary", tracing=None, tokenizer=None, proxy_echoes_id: bool = False):
        self.mode, self.tracing, self.tokenizer, self.proxy_echoes_id = mode, tracing, tokenizer, proxy_echoes_id

    @classmethod
    def from_config(cls, cfg, tokenizer=None, proxy_echoes_id: bool = False) -> "RequestLog":
        tracing = None
        if cfg.otlp_traces_endpoint:
            from ray_attn.serve.tracing import Tracing  # only when on: tracing off imports nothing

            tracing = Tracing.otlp(cfg.otlp_traces_endpoint)
        return cls(cfg.log_requests, tracing, tokenizer, proxy_echoes_id)

    def start(self, scope) -> tuple[RequestRecord, Optional[bytes]]:
        """The record of a new request and the ``X-Request-Id`` value its response must carry
        (None when Serve's proxy adds it)."""
        rid, given = request_id_of(scope)
        rec = RequestRecord(rid, client_host(scope), scope.get("method", ""), route_path(scope),
                            full=self.mode == "full")
        if self.tracing is not None:
            rec.traceparent = next((v.decode("latin-1") for k, v in scope.get("headers", ())
                                    if k == b"traceparent"), None)
        echoed = self.proxy_echoes_id and given is not None and given == rid.encode()
        return rec, None if echoed else rid.encode()

    def finish(self, rec: RequestRecord) -> None:
        rec.ended_ns = time.time_ns()
        if self.mode != "off":
            log_line(rec, self._full(rec) if rec.full else "")
        if self.tracing is not None:
            try:
                self.tracing.record(rec)
            except Exception:  # noqa: BLE001 - a tracing failure must not fail the request
                log.exception("tracing: could not record request %s", rec.request_id)

    def _full(self, rec: RequestRecord) -> str:
        body = bytes(rec.body).decode("utf-8", "replace")
        outputs = []
        for i in sorted(rec.outputs):
            ids = rec.outputs[i]
            text = self.tokenizer.decode(ids) if self.tokenizer is not None else None
            outputs.append(f"{i}:{ids!r}" if text is None else f"{i}:{text!r}")
        return (f" prompt={_shown(body, MAX_LOGGED_CHARS)!r}"
                f" output=[{_shown(', '.join(outputs), MAX_LOGGED_CHARS)}]")


class RequestMiddleware:
    """Gives each request (through ``log_of()``, the replica's :class:`RequestLog`; None
    outside a replica lets everything through) its id, its record and its log line."""

    def __init__(self, app, log_of: Callable[[], Optional[RequestLog]]):
        self.app, self.log_of = app, log_of

    async def __call__(self, scope, receive, send):
        rl = self.log_of() if scope["type"] == "http" else None
        if rl is None:
            return await self.app(scope, receive, send)
        rec, header = rl.start(scope)
        started = False

        async def send_with_id(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                rec.status = message["status"]
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != REQUEST_ID_HEADER]
                if header is not None:
                    headers.append((REQUEST_ID_HEADER, header))
                message = dict(message, headers=headers)
            await send(message)

        if rec.full:
            receive = _keeping_body(receive, rec)
        token = _current.set(rec)
        try:
            await self.app(scope, receive, send_with_id)
        except asyncio.CancelledError:
            rec.cancelled = True
            raise
        except Exception as e:  # noqa: BLE001 - answered here so that the 500 carries the id too
            if started:
                raise
            log.exception("request %s failed", rec.request_id)
            await server_error(e).response()(scope, receive, send_with_id)
        finally:
            _current.reset(token)
            rl.finish(rec)


def _keeping_body(receive, rec: RequestRecord):
    async def wrapped():
        message = await receive()
        if message.get("type") == "http.request":
            rec.body += message.get("body", b"")
        return message
    return wrapped


__all__ = ["ObservedLoop", "RecordingSink", "RequestLog", "RequestMiddleware", "RequestRecord",
           "current_request", "current_request_id", "request_id_of", "with_request_id"]
