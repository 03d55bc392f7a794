"""The front's answer to one request: the replica's ASGI messages relayed as they come, a
replica lost under it replaced (``resume.py``), and -- for a stream -- every event numbered and
written to the stream's log before it is sent (``progress_store.py``), so that a client whose
front replica is lost reconnects to another one and goes on where it stopped.

The reconnection contract (the SSE convention, ``Last-Event-ID``):

- with ``resume_requests`` every event of a stream opens with ``id: <n>``, n its 0-based
  position in the stream (``[DONE]`` and error events included);
- a client whose stream was cut before ``[DONE]`` sends the same request again -- same method,
  path, body and ``Authorization`` -- with the same ``X-Request-Id`` and ``Last-Event-ID: <n>``,
  n the id of the last event it got, to any front replica, within ``resume_window_s``;
- the answer is a 200 event stream that goes on at event n + 1: the events the log holds are
  sent from it, the rest by a replica resumed where the log ends; no event twice, none lost;
- no record of the stream (never one, or older than the window, or every copy lost): 410; the
  request differs from the one logged: 409 naming ``body``; an id beyond what was sent: 409
  naming ``last-event-id``.  A request without ``Last-Event-ID`` is a new request, whatever
  its id.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from typing import Optional

from ray.serve.exceptions import BackPressureError
from starlette.responses import Response

from ray_attn.serve.http import HTTPError
from ray_attn.serve.progress_store import StreamRecord, Superseded, Write
from ray_attn.serve.resume import EventIds, StreamProgress

log = logging.getLogger("ray.serve")

REPLICA_HEADER = b"x-replica-id"
FRONT_HEADER = b"x-ray-attn-front"      # the front replica that answered
ATTEMPT_HEADER = b"x-ray-attn-attempt"  # which attempt's replica began the answer (1: the first)
REPLICA_COMMENT = b": replica %s from event %d\n\n"  # a stream resumed on another replica, mid-stream


async def send_error(send, status: int, field_name: str, detail: str, headers=()) -> None:
    body = json.dumps(HTTPError(status, [(field_name, detail)]).body()).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        *headers]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class StreamJournal:
    """One stream's log as this front writes it: what was sent, ahead of sending it."""

    def __init__(self, stores, request_id: str, digest: str, epoch: int, record: Optional[StreamRecord] = None):
        self.stores, self.request_id, self.digest, self.epoch = stores, request_id, digest, epoch
        self.events = list(record.events) if record else []
        self.progress = list(record.progress) if record else []
        self.replicas = list(record.replicas) if record else []
        self.copies = None  # how many stores held the last write
        self.warned = False

    def _write(self, start: int, pstart: int, done: bool) -> Write:
        return Write(self.request_id, self.epoch, self.digest, start, tuple(self.events[start:]), pstart,
                     tuple(self.progress[pstart:]), tuple(self.replicas), done)

    async def append(self, events: list[bytes], lines: list[bytes], done: bool) -> None:
        start, pstart = len(self.events), len(self.progress)
        self.events += events
        self.progress += lines
        try:
            self.copies = await self.stores.write(self._write(start, pstart, done), lambda: self._write(0, 0, done))
        except Superseded:
            raise
        except Exception as e:  # noqa: BLE001 - the stream goes on; only a reconnection would miss it
            self.copies = 0
            if not self.warned:
                log.warning("stream %s: progress not stored (%s: %s)", self.request_id, type(e).__name__, e)
                self.warned = True


class RelayedResponse(Response):
    """Sends the ASGI messages a replica's ``handle_http`` yields, as they come.

    Serve sends a returned Response by calling it as an ASGI app, so this is where the replica's
    answer meets the client.  When the replica fails (it died, its node was lost) the request
    goes to another replica, up to ``max_attempts`` times in all:

    - before it started answering (every non-streaming request, a stream before its headers,
      a stream before its first event), it is sent again as it came: the client sees one answer;
    - mid-stream, with ``resume``, it goes on where it stopped (``serve/resume.py``): the new
      replica's headers are dropped and its events relayed, so the client sees each token once;
    - a retry that no replica takes within ``retry_timeout_s`` (every replica gone) is given up;
    - when no attempt is left, or the stream cannot be resumed, a stream ends with an error
      event and ``[DONE]`` (never a cut that looks finished), and an answer not begun is a 503
      with Retry-After.  Serve's own queue being full is a 503 at once: a retry would only
      add to the queue.

    ``journal`` (a resumable stream) logs every event before it is sent; ``reconnect`` (a
    record taken over, with the client's ``last_event_id``) begins by sending what the log has
    after that event, then resumes a replica where the log ends."""

    def __init__(self, call, routed, retry_after_s: int, max_attempts: int = 1, retry_delay_s: float = 0.5,
                 retry_timeout_s: float = 60.0, request_id: Optional[bytes] = None,
                 journal: Optional[StreamJournal] = None, reconnect: Optional[StreamRecord] = None,
                 last_event_id: int = -1, front_id: Optional[bytes] = None):
        self.call, self.routed = call, routed
        self.retry = [(b"retry-after", str(retry_after_s).encode())]
        # The id the front gave a request whose own X-Request-Id it could not use: Serve's proxy
        # echoes the client's, so the answer names the one the replicas used too.
        self.id_header = [(b"x-request-id", request_id)] if request_id else []
        self.front_header = [(FRONT_HEADER, front_id)] if front_id else []
        self.max_attempts, self.retry_delay_s, self.retry_timeout_s = max_attempts, retry_delay_s, retry_timeout_s
        self.journal, self.reconnect, self.last_event_id = journal, reconnect, last_event_id
        self.background = None
        self.attempts = 0
        self.body_sent = False  # a byte of the answer reached the client: no resend from scratch

    async def __call__(self, scope, receive, send) -> None:
        async def to_client(message):
            try:
                await send(message)
            except Exception as e:  # noqa: BLE001 - the client's side failed, not a replica
                raise _ClientGone() from e
        try:
            await self._relay(to_client)
        except _ClientGone as e:
            raise e.__cause__ from None

    async def _relay(self, send) -> None:
        started, stream, progress, ids, routed = False, False, StreamProgress(), EventIds(), self.routed
        tail: list[bytes] = []
        if self.reconnect is not None:
            rec = self.reconnect
            progress.replay(rec.progress)
            ids.next = len(rec.events)
            tail = rec.events[self.last_event_id + 1:]
            if rec.done:  # it ended: the client only missed its last events
                await send({"type": "http.response.start", "status": 200, "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                    *self.id_header, *self.front_header]})
                await send({"type": "http.response.body", "body": b"".join(tail), "more_body": False})
                return
            if progress.state.head:
                routed = dataclasses.replace(routed, resume=progress.state.to_json())
        self.ids = ids
        while True:
            self.attempts += 1
            try:
                # A client that goes away cancels this; Serve then cancels the handle call, and
                # run_asgi the replica's handler, which aborts the request and frees its blocks.
                async for message in self._messages(routed):
                    kind = message.get("type")
                    if kind == "http.response.start":
                        replica = _header(message, REPLICA_HEADER)
                        if self.journal is not None and replica:  # who served it, from which event
                            self.journal.replicas.append((replica.decode(), ids.next))
                        if started:  # a resumed stream: the client has its headers already
                            if message.get("status") != 200 or not _is_event_stream(message):
                                raise _NotResumed(f"the next replica answered {message.get('status')}")
                            if replica and stream and not ids.pending:
                                # an SSE comment (clients skip it, no id): the stream goes on from
                                # another replica -- the one sign of it a client can see
                                await send({"type": "http.response.body", "more_body": True,
                                            "body": REPLICA_COMMENT % (replica, ids.next)})
                            continue
                        started = True
                        stream = _is_event_stream(message) and message.get("status") == 200
                        message = dict(message, headers=[*message.get("headers", ()), *self.id_header,
                                                         *self.front_header,
                                                         (ATTEMPT_HEADER, str(self.attempts).encode())])
                        await send(message)
                        if tail and stream:  # a reconnection: what the log has after Last-Event-ID
                            await send({"type": "http.response.body", "body": b"".join(tail), "more_body": True})
                        continue
                    if kind == "http.response.body" and stream and routed.resumable:
                        body, lines = progress.take(message.get("body", b""))
                        more = bool(message.get("more_body"))
                        body, events = ids.number(body)
                        if not more:
                            body += ids.flush()
                        if self.journal is not None and (events or lines or not more):
                            # ended with its [DONE] (the empty last message follows it)
                            done = not more or any(e.endswith(b"data: [DONE]\n\n") for e in events)
                            await self.journal.append(events, lines, done=done)
                        message = dict(message, body=body)
                    if kind == "http.response.body" and message.get("body"):
                        self.body_sent = True  # without resumption events are not numbered
                    await send(message)
                return
            except _ClientGone:
                raise
            except Superseded:
                log.info("stream %s taken over by a newer connection; this one ends", self.journal.request_id)
                return await self._end_stream(send, "x-request-id", "x-request-id: this stream was taken over "
                                                                    "by a newer connection with the same id",
                                              journal=False)
            except _NoReplica as e:
                if started:
                    return await self._end_stream(send, "replica", f"replica: {e}; retry the request")
                return await send_error(send, 503, "replica", f"replica: {e}; retry later",
                                        self.retry + self.id_header)
            except BackPressureError as e:
                if started:
                    return await self._end_stream(send, "queue", f"queue: every replica is at capacity ({e})")
                return await send_error(send, 503, "queue", f"queue: every replica is at capacity ({e}); "
                                                            f"retry later", self.retry + self.id_header)
            except Exception as e:  # noqa: BLE001 - a replica died under the request
                what = f"{type(e).__name__}"
                # A stream whose first event has not gone out yet (its replica died in prefill,
                # after the headers) is sent again as it came; one with events, from its progress.
                fresh = not started or (stream and not self.body_sent and ids.next == 0
                                         and not progress.state.head)
                resumable = fresh or (stream and routed.resumable and bool(progress.state.head))
                if isinstance(e, _NotResumed):
                    resumable = False
                log.warning("replica lost under a request (attempt %d of %d, %s): %s: %s", self.attempts,
                            self.max_attempts, "resuming" if started else "retrying", what, e)
                if self.attempts >= self.max_attempts or not resumable:
                    if not started:
                        return await send_error(send, 503, "replica", f"replica: request failed ({what}); "
                                                                      f"retry later", self.retry + self.id_header)
                    if not stream:
                        raise
                    return await self._end_stream(send, "replica", f"replica: lost mid-stream ({what}) and "
                                                                   f"not resumed; retry the request")
                if started and not fresh:
                    routed = dataclasses.replace(routed, resume=progress.state.to_json())
                await asyncio.sleep(self.retry_delay_s)  # Serve's router learns of the loss meanwhile

    async def _messages(self, routed):
        """The replica's messages; a retry that gets none within ``retry_timeout_s`` (every
        replica gone: Serve's router would hold it until one comes back) is ``_NoReplica``."""
        response = self.call(routed)
        it = response.__aiter__()
        wait = self.retry_timeout_s if self.attempts > 1 or self.reconnect is not None else None
        while True:
            try:
                message = await (asyncio.wait_for(it.__anext__(), wait) if wait else it.__anext__())
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                getattr(response, "cancel", lambda: None)()
                raise _NoReplica(f"no replica took the request again within {self.retry_timeout_s:g}s "
                                 f"(retry_timeout_s)") from None
            wait = None
            yield message

    async def _end_stream(self, send, field_name: str, detail: str, journal: bool = True) -> None:
        """An in-stream error event (vLLM's, as ``openai/serving.sse_error``), then the end;
        numbered and logged like the replica's events (a reconnection finds the same end)."""
        err = json.dumps(HTTPError(503, [(field_name, detail)]).body())
        body, events = self.ids.number(f"data: {err}\n\ndata: [DONE]\n\n".encode())
        if journal and self.journal is not None:
            try:
                await self.journal.append(events, [], done=True)
            except Exception:  # noqa: BLE001 - the client gets its end anyway
                pass
        await send({"type": "http.response.body", "body": body, "more_body": False})


class _NoReplica(Exception):
    pass


class _ClientGone(Exception):
    pass


class _NotResumed(Exception):
    pass


def _header(start: dict, name: bytes) -> Optional[bytes]:
    for k, v in start.get("headers", ()):
        if k.lower() == name:
            return v
    return None


def _is_event_stream(start: dict) -> bool:
    v = _header(start, b"content-type")
    return v is not None and v.startswith(b"text/event-stream")


def new_epoch(after: int = 0) -> int:
    """An epoch newer than ``after`` (and than any taken earlier on a clock in step)."""
    return max(time.time_ns(), after + 1)


__all__ = ["ATTEMPT_HEADER", "FRONT_HEADER", "REPLICA_COMMENT", "REPLICA_HEADER", "RelayedResponse", "StreamJournal", "new_epoch",
           "send_error"]
