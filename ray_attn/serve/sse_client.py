"""A client for the reconnection contract of ``relay.py``: one streamed request that, when its
connection is cut before ``[DONE]``, is sent again with the same ``X-Request-Id`` and the
``Last-Event-ID`` of the last event it got, and goes on where it stopped.

Browsers' ``EventSource`` reconnects by itself (GET only); the OpenAI Python SDK does not: its
``Stream`` ends when the connection does (an ``httpx`` error mid-body, or simply the end of the
iteration when the server closed cleanly), and its ``max_retries`` only covers a request that
got no answer.  A client of this server reconnects as here, or with the SDK by passing the
headers itself (``extra_headers={"X-Request-Id": rid, "Last-Event-ID": str(n)}``, n the number
of chunks it got minus one: the ids count the events from 0, so counting chunks is enough).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional

import httpx

# 500: Serve's proxy, when the front replica it picked died before answering
RETRYABLE = {500, 502, 503, 504}


@dataclass
class Connection:
    status: int
    front: Optional[str]
    replica: Optional[str]
    attempt: Optional[str]
    first_event: int  # the id of its first event (-1: none came)
    error: Optional[str] = None
    # (replica, first event id) for each replica the front resumed the stream on, mid-connection
    # (relay.REPLICA_COMMENT): a replica lost under the stream that the client never saw cut
    resumed_on: list = field(default_factory=list)


@dataclass
class ResumableStream:
    request_id: str
    events: list = field(default_factory=list)   # the data of each event, parsed ("[DONE]" as is)
    ids: list = field(default_factory=list)      # each event's id (None: the server sent none)
    connections: list = field(default_factory=list)
    done: bool = False
    error: Optional[str] = None

    @property
    def reconnects(self) -> int:
        return max(0, len(self.connections) - 1)

    @property
    def replicas(self) -> list:
        """Every replica that served the stream, in order (from headers and resume comments)."""
        out = []
        for c in self.connections:
            for r in ([c.replica] if c.replica else []) + [r for r, _ in c.resumed_on]:
                if not out or out[-1] != r:
                    out.append(r)
        return out

    @property
    def last_id(self) -> Optional[int]:
        return self.ids[-1] if self.ids and self.ids[-1] is not None else None


def stream(url: str, body: dict, request_id: Optional[str] = None, headers: Optional[dict] = None,
           reconnect=True, max_connections: int = 6, backoff_s: float = 0.5, timeout: float = 120.0,
           on_event: Optional[Callable[[ResumableStream], None]] = None,
           on_open: Optional[Callable[[ResumableStream], None]] = None) -> ResumableStream:
    """POST ``body`` to ``url`` as a stream, reconnecting until ``[DONE]`` or ``max_connections``
    connections; ``reconnect`` may be a callable of the stream, asked at each cut.
    ``on_open(s)`` runs when a connection's headers arrive, ``on_event(s)`` after each event."""
    s = ResumableStream(request_id or uuid.uuid4().hex)
    with httpx.Client(timeout=timeout) as c:
        while len(s.connections) < max_connections:
            h = dict(headers or {}, **{"X-Request-Id": s.request_id})
            if s.last_id is not None:
                h["Last-Event-ID"] = str(s.last_id)
            conn = Connection(0, None, None, None, -1)
            s.connections.append(conn)
            try:
                with c.stream("POST", url, json=body, headers=h) as r:
                    conn.status = r.status_code
                    conn.front, conn.replica = r.headers.get("x-ray-attn-front"), r.headers.get("x-replica-id")
                    conn.attempt = r.headers.get("x-ray-attn-attempt")
                    if r.status_code != 200:
                        conn.error = r.read().decode(errors="replace")[:500]
                        if r.status_code not in RETRYABLE:
                            s.error = f"HTTP {r.status_code}: {conn.error}"
                            return s
                    else:
                        if on_open is not None:
                            on_open(s)
                        _read(r, s, conn, on_event)
                        if s.done:
                            return s
            except httpx.HTTPError as e:
                conn.error = f"{type(e).__name__}: {e}"
            if not (reconnect(s) if callable(reconnect) else reconnect):
                s.error = conn.error or "the stream ended before [DONE]"
                return s
            time.sleep(backoff_s)
    s.error = f"no [DONE] after {max_connections} connections"
    return s


def _read(r: httpx.Response, s: ResumableStream, conn: Connection, on_event) -> None:
    event_id = None
    for line in r.iter_lines():
        if line.startswith("id: "):
            event_id = int(line[4:])
        elif (moved := replica_comment(line)) is not None:
            conn.resumed_on.append(moved)
        elif line.startswith("data: "):
            data = line[6:]
            s.events.append(data if data == "[DONE]" else json.loads(data))
            if isinstance(s.events[-1], dict) and s.events[-1].get("error") and s.error is None:
                s.error = str(s.events[-1].get("detail") or s.events[-1]["error"])  # an in-stream error event
            s.ids.append(event_id)
            if conn.first_event < 0 and event_id is not None:
                conn.first_event = event_id
            event_id = None
            if data == "[DONE]":
                s.done = True
            if on_event is not None:
                on_event(s)
            if s.done:
                return


def replica_comment(line: str) -> Optional[tuple]:
    """(replica, first event id) of a ``relay.REPLICA_COMMENT`` line; None for any other line."""
    if not line.startswith(": replica "):
        return None
    replica, _, first = line[len(": replica "):].partition(" from event ")
    return replica, int(first) if first.isdigit() else None


def faults(s: ResumableStream) -> tuple[int, int]:
    """(events repeated, events skipped) by their ids, over every connection."""
    dup = gap = 0
    seen = -1
    for i in s.ids:
        if i is None:
            continue
        if i <= seen:
            dup += 1
        elif i > seen + 1:
            gap += i - seen - 1
        seen = max(seen, i)
    return dup, gap


__all__ = ["Connection", "ResumableStream", "faults", "replica_comment", "stream"]
