"""Streams that survive their replica: what the front records while it relays, and what a new
replica needs to carry on.

A replica that dies (its node lost, its process killed) ends every stream it was serving.  The
front deployment (``ingress.py``) holds each request's body, so it can send the request again to
another replica -- but the client has already seen part of the answer, and must see each token
exactly once.  The front therefore asks the replica for **progress**: with the request it sends
``resumable``, and the replica's SSE routes then put, in the same body message as each event, an
SSE comment line::

    : ray-attn-progress {"i": 0, "t": [17, 4], "f": null, "s": null}

(choice index, the token ids the event carries, the choice's finish and stop reason once it
ends; a first line carries the stream's ``head``, its id and created time).  The front strips
these lines before relaying -- the client gets the bytes a direct request gets -- and keeps the
sum.  When the replica fails mid-stream it sends the request again with that sum as ``resume``;
the new replica prefills each unfinished choice's prompt plus its tokens so far
(``LLMEngine.add_request(output_token_ids=...)``), primes its detokenizer with them, skips what
was already sent (the chat role chunk, the echoed prompt) and streams the rest under the same
id.  Greedy and seeded sampling continue as they would have: a seeded draw depends on the
token's index, which counts the resumed tokens.

Both travel in the ASGI scope's extensions (``scope["extensions"]["ray_attn"]``), set only by the
replica's ``handle_http`` from a ``RoutedHTTPRequest``: an HTTP client cannot claim outputs.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

EXTENSION = "ray_attn"
PREFIX = b": ray-attn-progress "
_LINE = re.compile(rb": ray-attn-progress ([^\n]*)\n\n")


@dataclass
class ChoiceProgress:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Any = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Resume:
    """What a stream's client has seen: its head (id, created) and each choice's tokens."""

    head: dict = field(default_factory=dict)
    choices: dict[int, ChoiceProgress] = field(default_factory=dict)
    usage_sent: bool = False  # the final usage chunk went out (only [DONE] was lost)

    def to_json(self) -> dict:
        return {"head": self.head, "usage_sent": self.usage_sent,
                "choices": {str(i): [list(c.token_ids), c.finish_reason, c.stop_reason] for i, c in self.choices.items()}}

    @classmethod
    def from_json(cls, data: dict) -> "Resume":
        choices = {int(i): ChoiceProgress(list(map(int, t)), f, s) for i, (t, f, s) in data["choices"].items()}
        return cls(dict(data.get("head") or {}), choices, bool(data.get("usage_sent")))

    def tokens(self, index: int) -> list[int]:
        c = self.choices.get(index)
        return list(c.token_ids) if c is not None else []


# ------------------------------------------------------------------------------ replica side
@dataclass(frozen=True)
class ResumeContext:
    """What the front asked of this request: progress lines, and where to start."""

    resumable: bool = False
    resume: Optional[Resume] = None


NOT_RESUMABLE = ResumeContext()


def context(request) -> ResumeContext:
    """The request's ResumeContext (NOT_RESUMABLE for a direct HTTP request)."""
    ext = (request.scope.get("extensions") or {}).get(EXTENSION)
    if not ext:
        return NOT_RESUMABLE
    raw = ext.get("resume")
    return ResumeContext(bool(ext.get("resumable")), Resume.from_json(raw) if raw else None)


def progress_line(**fields) -> str:
    """One progress comment (empty fields left out)."""
    return PREFIX.decode() + json.dumps(fields, separators=(",", ":")) + "\n\n"


def choice_progress(index: int, token_ids: list[int], finish_reason=None, stop_reason=None) -> str:
    return progress_line(i=index, t=list(token_ids), f=finish_reason, s=stop_reason)


# -------------------------------------------------------------------------------- front side
class StreamProgress:
    """Sums the progress lines of one relayed stream and strips them from what it relays."""

    def __init__(self):
        self.state = Resume()
        self.done = False  # the stream's last body message was relayed

    def feed(self, body: bytes) -> bytes:
        return self.take(body)[0]

    def take(self, body: bytes) -> tuple[bytes, list[bytes]]:
        """``body`` without its progress lines, and the lines (summed into ``state``)."""
        if PREFIX not in body:
            return body, []
        lines = [m.group(0) for m in _LINE.finditer(body)]
        self.replay(lines)
        return _LINE.sub(b"", body), lines

    def replay(self, lines) -> None:
        """Sum progress lines kept elsewhere (a stream's log, ``progress_store.py``)."""
        for m in _LINE.finditer(b"".join(lines)):
            p = json.loads(m.group(1))
            if "head" in p:
                self.state.head = p["head"]
            if p.get("u"):
                self.state.usage_sent = True
            if "i" in p:
                c = self.state.choices.setdefault(int(p["i"]), ChoiceProgress())
                c.token_ids += p.get("t") or []
                if p.get("f") is not None:
                    c.finish_reason, c.stop_reason = p["f"], p.get("s")


class EventIds:
    """Numbers the events of a relayed stream for reconnection: an ``id: <n>`` line opens each
    (n its 0-based position in the stream, ``[DONE]`` and error events included), so that a
    client's ``Last-Event-ID`` says exactly what it holds -- and one that counts the events it
    got (an SDK's chunks) knows the id without reading it."""

    def __init__(self, next_id: int = 0):
        self.next = next_id
        self._rest = b""

    def number(self, body: bytes) -> tuple[bytes, list[bytes]]:
        """``body`` with its whole events numbered, and those events; an unfinished tail waits
        for the next body."""
        parts = (self._rest + body).split(b"\n\n")
        self._rest = parts.pop()
        events = []
        for p in parts:
            if p.strip():
                events.append(b"id: %d\n" % self.next + p + b"\n\n")
                self.next += 1
        return b"".join(events), events

    def flush(self) -> bytes:
        rest, self._rest = self._rest, b""
        return rest

    @property
    def pending(self) -> bool:
        """Part of an event is held back (a body ended mid-event): nothing may be sent between."""
        return bool(self._rest)


__all__ = ["ChoiceProgress", "EXTENSION", "EventIds", "NOT_RESUMABLE", "Resume", "ResumeContext", "StreamProgress",
           "choice_progress", "context", "progress_line"]
