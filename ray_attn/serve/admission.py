"""Bounds on the requests one replica holds open: in total, and per client address.

A request counts from the moment it enters the app until its response is fully sent (a stream
included), so a client still sending its body -- or stalling half-way through it -- counts.  One
more than ``max_connections`` is answered 503 at once, one more than ``max_requests_per_client``
from the same address 429 at once, both with ``Retry-After`` and the error body of every route.
``/health``, ``/stats`` and ``/metrics`` are never counted: a load balancer must see a busy replica as busy, not
as down.

It is an ASGI middleware rather than a check in each handler because a streamed response outlives
its handler (the handler returns the ``StreamingResponse`` before the first token), and because the
``finally`` of one ASGI call is the one place where releasing the count cannot be skipped --
whether the response ended, the client went away or the request was cancelled.

Serve's own ``max_ongoing_requests`` is set above ``max_connections`` (``ray_attn/serve/app.py``
``deployment_options``) so that these bounds bite first and the answers stay ours.
"""

import threading
from collections import Counter
from typing import Callable, Optional

from ray_attn.serve.http import HTTPError

EXEMPT_PATHS = frozenset({"/health", "/stats", "/metrics"})


class Admission:
    """The open-request counts of one replica.  ``enter`` either counts a request or returns the
    refusal to send; every counted request must be matched by one ``leave``."""

    def __init__(self, max_connections: int, max_requests_per_client: int, retry_after_s: int,
                 body_timeout_s: float, on_refused: Optional[Callable[[int], None]] = None):
        if not 0 < max_requests_per_client <= max_connections:
            raise ValueError(f"max_requests_per_client: {max_requests_per_client} must be in "
                             f"[1, max_connections={max_connections}]")
        self.max_connections = max_connections
        self.max_requests_per_client = max_requests_per_client
        self.retry_after_s = retry_after_s
        self.body_timeout_s = body_timeout_s
        self.on_refused = on_refused  # the refusal's status, to a metric
        # Serve may run user code off its own loop's thread: a lock keeps the counts exact either way.
        self._lock = threading.Lock()
        self._open = 0
        self._by_client: Counter[str] = Counter()
        self._refused = Counter()  # by status

    def enter(self, client: str) -> Optional[HTTPError]:
        refusal = self._enter(client)
        if refusal is not None and self.on_refused is not None:
            self.on_refused(refusal.status)
        return refusal

    def _enter(self, client: str) -> Optional[HTTPError]:
        retry = {"Retry-After": str(self.retry_after_s), "Connection": "close"}
        with self._lock:
            if self._by_client[client] >= self.max_requests_per_client:
                self._refused[429] += 1
                return HTTPError(429, [("client", (
                    f"client: {self._by_client[client]} requests from {client} are already open on "
                    f"this replica (max_requests_per_client={self.max_requests_per_client}); "
                    f"retry later"))], retry)
            if self._open >= self.max_connections:
                self._refused[503] += 1
                return HTTPError(503, [("connections", (
                    f"connections: the replica already holds {self._open} open requests "
                    f"(max_connections={self.max_connections}); retry later"))], retry)
            self._open += 1
            self._by_client[client] += 1
        return None

    def leave(self, client: str) -> None:
        with self._lock:
            self._open -= 1
            left = self._by_client[client] - 1
            if left > 0:
                self._by_client[client] = left
            else:
                del self._by_client[client]  # an address seen once must not stay in memory

    def stats(self) -> dict:
        with self._lock:
            return dict(connections_open=self._open, max_connections=self.max_connections,
                        max_requests_per_client=self.max_requests_per_client,
                        clients_open=len(self._by_client),
                        requests_rejected_connections=self._refused[503],
                        requests_rejected_client=self._refused[429])


def route_path(scope) -> str:
    """The path inside the app (``/health``), also under a route prefix (``/plain/health``)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root):
        return path[len(root):] or "/"
    return path


def client_host(scope) -> str:
    """The peer's address as the HTTP server saw it.  Behind Serve's proxy this is the TCP peer of
    the proxy's uvicorn -- or, for a peer on the proxy's own host (uvicorn's default
    ``forwarded_allow_ips``), the address in its X-Forwarded-For header."""
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


class AdmissionMiddleware:
    """Counts each request through ``gate_of()`` (the replica's :class:`Admission`; None lets
    everything through) and adds ``Retry-After`` to any 503 or 429 that lacks one."""

    def __init__(self, app, gate_of: Callable[[], Optional[Admission]]):
        self.app, self.gate_of = app, gate_of

    async def __call__(self, scope, receive, send):
        gate = self.gate_of() if scope["type"] == "http" else None
        if gate is None:
            return await self.app(scope, receive, send)
        send = _with_retry_after(send, gate.retry_after_s)
        if route_path(scope) in EXEMPT_PATHS:
            return await self.app(scope, receive, send)
        client = client_host(scope)
        refusal = gate.enter(client)
        if refusal is not None:
            return await refusal.response()(scope, receive, send)
        scope.setdefault("state", {})["body_timeout_s"] = gate.body_timeout_s
        try:
            await self.app(scope, receive, send)
        finally:
            gate.leave(client)


def _with_retry_after(send, retry_after_s: int):
    async def wrapped(message):
        if message["type"] == "http.response.start" and message["status"] in (429, 503):
            headers = list(message.get("headers", []))
            if not any(k.lower() == b"retry-after" for k, _ in headers):
                headers.append((b"retry-after", str(retry_after_s).encode()))
                message = dict(message, headers=headers)
        await send(message)
    return wrapped
