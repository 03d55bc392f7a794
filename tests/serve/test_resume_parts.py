"""The front's resumption logic without Ray (``serve/resume.py``, ``ingress.RelayedResponse``):
fake replicas yield ASGI messages with progress lines and fail on cue; what the client is sent
and what the next replica is asked are checked message by message."""

from __future__ import annotations

import asyncio
import json

import pytest

from ray_attn.serve.ingress import RelayedResponse, RoutedHTTPRequest
from ray_attn.serve.resume import Resume, StreamProgress, choice_progress, progress_line

START = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}


def event(i: int, toks: list[int], finish=None) -> dict:
    data = f"data: {json.dumps({'index': i, 'token_ids': toks})}\n\n"
    return {"type": "http.response.body", "body": (choice_progress(0, toks, finish) + data).encode(),
            "more_body": True}


def test_progress_lines_are_stripped_and_summed():
    p = StreamProgress()
    body = (progress_line(head={"id": "x", "created": 1}) + "data: a\n\n"
            + choice_progress(1, [4, 5]) + "data: b\n\n" + choice_progress(1, [6], "stop", 7)).encode()
    assert p.feed(body) == b"data: a\n\ndata: b\n\n"
    assert p.state.head == {"id": "x", "created": 1}
    c = p.state.choices[1]
    assert c.token_ids == [4, 5, 6] and c.finish_reason == "stop" and c.stop_reason == 7
    assert Resume.from_json(json.loads(json.dumps(p.state.to_json()))) == p.state


class FakeReplicas:
    """Each call yields the next script's messages; an Exception instance in a script is raised."""

    def __init__(self, *scripts):
        self.scripts = list(scripts)
        self.asked: list[RoutedHTTPRequest] = []

    def __call__(self, routed):
        self.asked.append(routed)
        script = self.scripts.pop(0)

        async def gen():
            for m in script:
                if isinstance(m, BaseException):
                    raise m
                if m == "hang":
                    await asyncio.Event().wait()
                yield m
        return gen()


def relay(replicas, attempts=3, retry_timeout_s=5.0) -> list[dict]:
    sent = []

    async def send(m):
        sent.append(m)

    routed = RoutedHTTPRequest({"type": "http"}, b"{}", resumable=True)
    resp = RelayedResponse(replicas, routed, retry_after_s=1, max_attempts=attempts, retry_delay_s=0.0,
                           retry_timeout_s=retry_timeout_s)
    asyncio.run(resp(None, None, send))
    return sent


def client_bytes(sent) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def numbered(text: str) -> list[tuple[int, str]]:
    """The stream's events as (id, data); every event must carry its id, the ids counting up."""
    out = []
    for block in text.split("\n\n")[:-1]:
        lines = block.split("\n")
        assert lines[0].startswith("id: ") and lines[1].startswith("data: "), block
        out.append((int(lines[0][4:]), lines[1][6:]))
    assert [i for i, _ in out] == list(range(len(out))), out
    return out


def test_a_stream_lost_mid_way_goes_on_at_the_next_replica():
    head = {"type": "http.response.body", "more_body": True,
            "body": progress_line(head={"id": "s1", "created": 5}).encode()}
    replicas = FakeReplicas(
        [START, head, event(0, [1, 2]), event(2, [3]), RuntimeError("replica died")],
        [START, event(3, [4, 5], "length"), {"type": "http.response.body", "body": b"data: [DONE]\n\n",
                                             "more_body": False}])
    sent = relay(replicas)
    assert [m["type"] for m in sent].count("http.response.start") == 1
    text = client_bytes(sent).decode()
    assert "ray-attn-progress" not in text
    got = [json.loads(d) for _, d in numbered(text) if d.startswith("{")]
    assert [t for e in got for t in e["token_ids"]] == [1, 2, 3, 4, 5]
    assert text.endswith("data: [DONE]\n\n")
    first, second = replicas.asked
    assert first.resume is None and second.resume is not None
    resumed = Resume.from_json(second.resume)
    assert resumed.head == {"id": "s1", "created": 5} and resumed.tokens(0) == [1, 2, 3]


def test_a_request_not_yet_answered_is_sent_again_as_it_came():
    body = {"type": "http.response.body", "body": b'{"ok": 1}', "more_body": False}
    replicas = FakeReplicas([RuntimeError("gone")],
                            [{"type": "http.response.start", "status": 200, "headers": []}, body])
    sent = relay(replicas)
    assert client_bytes(sent) == b'{"ok": 1}'
    assert [r.resume for r in replicas.asked] == [None, None]


@pytest.mark.parametrize("case", ["attempts", "no_progress", "no_replica"])
def test_what_cannot_be_resumed_ends_with_an_error_event(case):
    head = {"type": "http.response.body", "more_body": True,
            "body": progress_line(head={"id": "s", "created": 1}).encode()}
    if case == "attempts":
        replicas = FakeReplicas([START, head, event(0, [1]), RuntimeError("a")], [START, RuntimeError("b")])
    elif case == "no_progress":  # e.g. a chat stream that parses tool calls
        plain = {"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True}
        replicas = FakeReplicas([START, plain, RuntimeError("a")])
    else:  # every replica gone: the retry is never taken
        replicas = FakeReplicas([START, head, event(0, [1]), RuntimeError("a")], ["hang"])
    sent = relay(replicas, attempts=2, retry_timeout_s=0.2)
    text = client_bytes(sent).decode()
    assert text.endswith("data: [DONE]\n\n") and sent[-1]["more_body"] is False
    err = json.loads(numbered(text)[-2][1])
    assert err["field"] == "replica", err
    if case == "no_replica":
        assert "retry_timeout_s" in err["detail"]
