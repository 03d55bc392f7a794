"""A stream that outlives its front replica (``relay.py``, ``progress_store.py``), without Ray:
the stores are ``ProgressLog``s behind fake actor handles, the replicas scripted ASGI messages.

- events are numbered (SSE ``id:``), and every event is in the log before it is sent;
- the log is on two stores; a dead one leaves the other; a store that lacks the beginning
  gets the whole log; a newer connection's epoch stops the older writer;
- a client cut after any event -- the store ahead of it or not -- reconnects with
  ``Last-Event-ID`` and gets exactly the events after it, then a resumed replica's;
- a replica lost after the headers and before the first event: the request is sent again
  as it came (the prefill-death case);
- the front answers 410 / 409 / 400 to a reconnection it cannot honour.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from ray.exceptions import ActorDiedError

from ray_attn.serve.ingress import RoutedHTTPRequest
from ray_attn.serve.progress_store import GAP, OK, STALE, ProgressLog, ProgressStores, Superseded, Write, _Batcher
from ray_attn.serve.relay import RelayedResponse, StreamJournal, new_epoch
from ray_attn.serve.resume import EventIds, Resume, choice_progress, progress_line
from ray_attn.serve.sse_client import replica_comment

START = {"type": "http.response.start", "status": 200,
         "headers": [(b"content-type", b"text/event-stream"), (b"x-replica-id", b"r1")]}


def token_event(i: int, toks: list[int], finish=None) -> dict:
    data = f"data: {json.dumps({'index': i, 'token_ids': toks})}\n\n"
    return {"type": "http.response.body", "body": (choice_progress(0, toks, finish) + data).encode(),
            "more_body": True}


HEAD = {"type": "http.response.body", "more_body": True, "body": progress_line(head={"id": "s", "created": 1}).encode()}
END = {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False}


def script(tokens: list[int], start: int = 0, head: bool = True, replica: bytes = b"r1") -> list:
    """A replica's answer: one event per token from ``start``, the last one finishing."""
    st = dict(START, headers=[(b"content-type", b"text/event-stream"), (b"x-replica-id", replica)])
    out = [st] + ([HEAD] if head else [])
    for k in range(start, len(tokens)):
        out.append(token_event(k, [tokens[k]], "length" if k == len(tokens) - 1 else None))
    return out + [END]


class Replicas:
    def __init__(self, *scripts):
        self.scripts, self.asked = list(scripts), []

    def __call__(self, routed):
        self.asked.append(routed)
        messages = self.scripts.pop(0)

        async def gen():
            for m in messages:
                if isinstance(m, BaseException):
                    raise m
                yield m
        return gen()


class FakeStore:
    """An actor handle's shape (``handle.method.remote(...)`` awaitable) over a ProgressLog."""

    def __init__(self):
        self.log, self.dead, self.calls = ProgressLog(), False, 0
        store = self

        class Method:
            def __init__(self, fn):
                self.fn = fn

            def remote(self, *a):
                async def run():
                    store.calls += 1
                    if store.dead:
                        raise ActorDiedError()  # what a call to a lost actor raises
                    return self.fn(*a)
                return run()
        self.write_many = Method(lambda ws: [self.log.write(w, 0.0) for w in ws])
        self.takeover = Method(self.log.takeover)
        self.ping = Method(self.log.stats)


def stores_of(nodes: dict[str, FakeStore], me: str) -> ProgressStores:
    s = ProgressStores("app", me, window_s=60.0, write_timeout_s=0.5)
    s.batchers = {n: _Batcher(n, h) for n, h in nodes.items()}

    async def refresh(force=False):
        s.batchers = {n: b for n, b in s.batchers.items() if not nodes[n].dead or not b.dead}
    s.refresh = refresh
    return s


def numbered(body: bytes, resumed: list | None = None) -> list[tuple[int, str]]:
    """The numbered events of a relayed body; ``resumed`` collects its replica comments
    (``relay.REPLICA_COMMENT``: the stream went on from another replica), which carry no id."""
    out = []
    for block in body.decode().split("\n\n")[:-1]:
        moved = replica_comment(block)
        if moved is not None:
            if resumed is not None:
                resumed.append(moved)
            continue
        lines = block.split("\n")
        assert lines[0].startswith("id: ") and lines[1].startswith("data: "), block
        out.append((int(lines[0][4:]), lines[1][6:]))
    return out


class Cut(Exception):
    """The client's connection (or its front) gone after so many body messages."""


def run_relay(resp: RelayedResponse, cut_after: int | None = None) -> list[dict]:
    sent = []

    async def send(m):
        if cut_after is not None and m["type"] == "http.response.body" and \
                sum(x["type"] == "http.response.body" for x in sent) >= cut_after:
            raise Cut()
        sent.append(m)

    try:
        asyncio.run(resp(None, None, send))
    except Cut:
        pass
    return sent


def body_of(sent) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def routed():
    return RoutedHTTPRequest({"type": "http", "headers": []}, b"{}", resumable=True)


# ------------------------------------------------------------------------------------- pieces
def test_events_are_numbered_whole_and_in_order():
    ids = EventIds()
    b1, e1 = ids.number(b"data: a\n\ndata: b\n\ndata: c")
    assert b1 == b"id: 0\ndata: a\n\nid: 1\ndata: b\n\n" and len(e1) == 2
    b2, _ = ids.number(b"\n\ndata: [DONE]\n\n")
    assert b2 == b"id: 2\ndata: c\n\nid: 3\ndata: [DONE]\n\n" and ids.next == 4


def test_the_log_keeps_epochs_apart():
    log = ProgressLog()
    w = Write("r", 5, "d", 0, (b"e0", b"e1"), 0, (b"p0",))
    assert log.write(w, 1.0) == OK
    assert log.write(Write("r", 5, "d", 3, (b"e3",)), 1.0) == GAP  # e2 never arrived
    assert log.write(Write("r", 5, "d", 2, (b"e2",), 1, (b"p1",)), 1.0) == OK
    assert log.takeover("r", 9)["events"] == [b"e0", b"e1", b"e2"]
    assert log.write(Write("r", 5, "d", 3, (b"x",), 2), 1.0) == STALE  # the old writer, after the takeover
    assert log.write(Write("r", 9, "d", 3, (b"e3",), 2), 1.0) == OK
    assert log.records["r"].events[-1] == b"e3" and log.records["r"].progress == [b"p0", b"p1"]
    assert log.prune(100.0, 60.0) == 1 and not log.records


def test_two_copies_a_dead_store_and_a_new_target_that_gets_the_whole_log():
    nodes = {"a": FakeStore(), "b": FakeStore(), "c": FakeStore()}
    s = stores_of(nodes, "a")
    j = StreamJournal(s, "r", "d", 7)

    async def go():
        await j.append([b"e0"], [b"p0"], False)
        assert j.copies == 2 and nodes["a"].log.records["r"].events == [b"e0"] and "r" not in nodes["c"].log.records
        nodes["b"].dead = True  # b's node lost: the next write finds it dead, then c takes its place
        await j.append([b"e1"], [], False)
        assert j.copies == 1
        await j.append([b"e2"], [], True)
        assert j.copies == 2
        assert nodes["c"].log.records["r"].events == [b"e0", b"e1", b"e2"] and nodes["c"].log.records["r"].done
        rec = await s.takeover("r", 8)
        assert rec.events == [b"e0", b"e1", b"e2"]
        with pytest.raises(Superseded):
            await j.append([b"late"], [], True)
    asyncio.run(go())


# ------------------------------------------------------------------------------ reconnection
TOKENS = [11, 12, 13, 14, 15, 16]


@pytest.mark.parametrize("cut_after,client_lags", [(1, 0), (3, 0), (4, 2), (len(TOKENS) + 1, 1), (5, 5)])
def test_a_client_cut_anywhere_reconnects_to_exactly_the_events_after_its_last(cut_after, client_lags):
    """The first front relays until the client is cut after ``cut_after`` body messages; the
    client held ``client_lags`` events fewer than the log (lost in flight).  Another front takes
    the record over and goes on; the client's events equal the fault-free stream's, once each."""
    clean = body_of(run_relay(RelayedResponse(Replicas(script(TOKENS)), routed(), 1, 3, retry_delay_s=0)))
    want = numbered(clean)
    nodes = {"a": FakeStore(), "b": FakeStore()}
    first = stores_of(nodes, "a")
    j1 = StreamJournal(first, "rid", "dig", new_epoch())
    sent = run_relay(RelayedResponse(Replicas(script(TOKENS)), routed(), 1, 3, retry_delay_s=0, journal=j1),
                     cut_after=cut_after)
    got = numbered(body_of(sent))
    logged = len(j1.events)
    assert logged >= len(got)  # written ahead of the send
    held = got[:max(0, len(got) - client_lags)]
    last = held[-1][0] if held else -1

    nodes["a"].dead = True  # the first front's node is gone: its copy with it
    other = stores_of(nodes, "b")

    async def take():
        return await other.takeover("rid", new_epoch())
    rec = asyncio.run(take())
    assert rec is not None and len(rec.events) == logged
    resumed_from = sum(1 for _, d in want[:logged] if d.startswith("{"))  # tokens the log holds
    replicas = Replicas(script(TOKENS, start=resumed_from, head=False, replica=b"r2"))
    j2 = StreamJournal(other, "rid", "dig", new_epoch(rec.epoch), record=rec)
    sent2 = run_relay(RelayedResponse(replicas, routed(), 1, 3, retry_delay_s=0, journal=j2, reconnect=rec,
                                      last_event_id=last))
    after = numbered(body_of(sent2))
    assert held + after == want, (held, after)
    if rec.done:
        assert replicas.asked == []  # it had ended: only the log's tail was sent
    else:
        asked = Resume.from_json(replicas.asked[0].resume)
        assert asked.tokens(0) == TOKENS[:resumed_from] and asked.head == {"id": "s", "created": 1}
        assert dict(sent2[0]["headers"])[b"x-replica-id"] == b"r2"


def test_a_replica_lost_after_the_headers_before_the_first_event_is_sent_again_as_it_came():
    """The prefill-death case: headers out, no event (not even the stream's head) -- the request
    goes again, fresh, to the next replica, and the client gets one whole stream."""
    replicas = Replicas([START, RuntimeError("replica died in prefill")], script(TOKENS))
    sent = run_relay(RelayedResponse(replicas, routed(), 1, 3, retry_delay_s=0))
    assert [m["type"] for m in sent].count("http.response.start") == 1
    resumed = []
    events = numbered(body_of(sent), resumed)
    assert [json.loads(d)["token_ids"][0] for _, d in events if d.startswith("{")] == TOKENS
    assert events[-1][1] == "[DONE]"
    assert [r.resume for r in replicas.asked] == [None, None]
    # the client is told that another replica took it, from the stream's first event
    assert len(resumed) == 1 and resumed[0] == ("r1", 0), resumed


# ------------------------------------------------------------------------- the front's answers
def front_with(stores):
    from ray_attn.serve.ingress import PrefixRoutingIngress

    front = PrefixRoutingIngress.func_or_class(_Handle(), block_size=16, max_body_bytes=1 << 20, retry_after_s=1,
                                               resume_requests=True, max_attempts=2, app_config={})
    front.stores = stores
    return front


class _Handle:
    def options(self, **_):
        return self

    def remote(self, routed):
        raise AssertionError("no replica should be asked")


def request(headers: dict, body: bytes = b'{"stream": true}'):
    from starlette.requests import Request

    scope = {"type": "http", "method": "POST", "path": "/v1/generate", "query_string": b"",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
    sent = [False]

    async def receive():
        if sent[0]:
            await asyncio.Event().wait()
        sent[0] = True
        return {"type": "http.request", "body": body, "more_body": False}
    return Request(scope, receive)


@pytest.mark.parametrize("case,status,field", [("unknown", 410, "last-event-id"), ("other-body", 409, "body"),
                                                ("beyond", 409, "last-event-id"), ("garbage", 400, "last-event-id")])
def test_a_reconnection_the_front_cannot_honour_is_refused_naming_the_field(case, status, field):
    from ray_attn.serve.progress_store import request_digest

    nodes = {"a": FakeStore()}
    s = stores_of(nodes, "a")
    digest = request_digest("POST", "/v1/generate", b'{"stream": true}', b"")
    nodes["a"].log.write(Write("known", 1, digest, 0, (b"id: 0\ndata: {}\n\n",)), 0.0)
    rid = "nope" if case == "unknown" else "known"
    last = {"beyond": "1", "garbage": "x"}.get(case, "0")
    body = b'{"stream": false}' if case == "other-body" else b'{"stream": true}'
    resp = asyncio.run(front_with(s)(request({"X-Request-Id": rid, "Last-Event-ID": last}, body)))
    assert resp.status_code == status
    assert json.loads(resp.body)["field"] == field


def test_a_stream_is_logged_as_ended_with_its_done_event():
    """Starlette sends an empty last message after ``[DONE]``: a front lost between the two
    leaves a log that must already say the stream ended (a reconnection then gets only the tail)."""
    nodes = {"a": FakeStore()}
    msgs = script(TOKENS)[:-1] + [dict(END, more_body=True), {"type": "http.response.body", "body": b"",
                                                                 "more_body": False}]
    j = StreamJournal(stores_of(nodes, "a"), "rid", "dig", new_epoch())
    sent = []

    async def send(m):  # the front dies the moment [DONE] is out
        sent.append(m)
        if b"[DONE]" in m.get("body", b""):
            raise Cut()
    with pytest.raises(Cut):
        asyncio.run(RelayedResponse(Replicas(msgs), routed(), 1, 3, retry_delay_s=0, journal=j)(None, None, send))
    assert numbered(body_of(sent))[-1][1] == "[DONE]"
    assert nodes["a"].log.records["rid"].done
