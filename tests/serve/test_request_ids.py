"""Request ids and request logs through the app itself (``tests/serve/app_harness.py``), and
the front (``ingress.py``) in process: the id a client sends, or one made for it, on every
answer; the engine requests named after it, also on the replica that resumes a stream; one log
line per request with no prompt or output unless asked."""

from __future__ import annotations

import asyncio
import json
import logging
import re

import pytest
from starlette.requests import Request

from ray_attn.serve.request_log import RequestLog
from tests.serve.app_harness import (API_KEY, MODEL_ID, asgi_call, base_config, bearer, client, completion,
                                     in_replica, keyed_server)

__all__ = ["in_replica"]
HEX32 = re.compile(r"[0-9a-f]{32}")
AUTH = ("authorization", f"Bearer {API_KEY}")


@pytest.fixture
def srv(in_replica, monkeypatch):
    """The shared keyed server; ``srv.engine_ids`` collects the (request_id asked, engine id
    given) of every engine request its loop takes."""
    s = in_replica(keyed_server())
    s.engine_ids = []
    submit = s.loop.inner.submit

    def spy(*args, request_id=None, **kw):
        rid = submit(*args, request_id=request_id, **kw)
        s.engine_ids.append((request_id, rid))
        return rid

    monkeypatch.setattr(s.loop.inner, "submit", spy)
    return s


def test_a_client_id_is_returned_and_names_the_engine_requests(srv):
    with client() as c:
        r = c.post("/v1/completions", json=completion(n=2), headers=bearer(API_KEY) | {"X-Request-Id": "trace-7_a.b:c"})
        assert r.status_code == 200 and r.headers.get_list("x-request-id") == ["trace-7_a.b:c"]
        assert r.json()["id"] == "cmpl-trace-7_a.b:c"
        # n=2: two engine requests under one id, told apart by the loop's count
        (a, ra), (b, rb) = srv.engine_ids
        assert a == b == "trace-7_a.b:c" and ra != rb and ra.startswith("trace-7_a.b:c-") and rb.startswith("trace-7_a.b:c-")
        r = c.post("/v1/generate", json={"prompt_token_ids": [1, 2], "max_tokens": 2},
                   headers=bearer(API_KEY) | {"X-Request-Id": "gen-1"})
        assert r.json()["id"] == srv.engine_ids[-1][1] and r.json()["id"].startswith("gen-1-")
        assert r.headers["x-request-id"] == "gen-1"


def test_an_id_is_made_when_none_or_an_unusable_one_comes(srv):
    seen = set()
    for given in (None, "x" * 129, "two words", "caf\xe9", ""):
        headers = [AUTH, ("content-type", "application/json")] + ([("x-request-id", given)] if given is not None else [])
        a = asgi_call("POST", "/v1/completions", headers, json.dumps(completion()).encode())
        assert a.status == 200 and HEX32.fullmatch(a.headers["x-request-id"]), (given, a.headers)
        assert a.json()["id"] == f"cmpl-{a.headers['x-request-id']}"
        seen.add(a.headers["x-request-id"])
    assert len(seen) == 5


def test_every_answer_carries_the_id_errors_included(srv, monkeypatch):
    def status_and_id(method, path, headers=(), body=b"", **kw):
        a = asgi_call(method, path, [("x-request-id", "err-1"), *headers], body, **kw)
        assert a.headers.get("x-request-id") == "err-1", (path, a.status, a.headers)
        return a.status

    assert status_and_id("POST", "/v1/completions") == 401
    assert status_and_id("GET", "/v1/nowhere", [AUTH]) == 404
    assert status_and_id("GET", "/v1/completions", [AUTH]) == 405
    assert status_and_id("POST", "/v1/completions", [AUTH, ("content-length", str(2 << 20))], b"{}") == 413
    assert status_and_id("POST", "/v1/completions", [AUTH], b"{not json") == 400
    assert status_and_id("POST", "/v1/generate", [AUTH], b'{"prompt_token_ids": "x"}') == 422
    assert status_and_id("GET", "/health") == 200
    stream = json.dumps(completion(stream=True)).encode()
    assert status_and_id("POST", "/v1/completions", [AUTH], stream) == 200

    def broken(*a, **kw):
        raise RuntimeError("a bug in a handler")

    monkeypatch.setattr(srv.loop.inner, "submit", broken)
    assert status_and_id("POST", "/v1/completions", [AUTH], json.dumps(completion()).encode()) == 500


def test_behind_serves_proxy_the_app_leaves_the_header_to_it():
    """Serve's proxy sends X-Request-ID with the id in the request's headers: the app adds its
    own only when it refused that id (else the client would get the header twice)."""
    def scope(value):
        return {"type": "http", "method": "GET", "path": "/", "headers": [] if value is None else [(b"x-request-id", value)]}

    behind = RequestLog(proxy_echoes_id=True)
    rec, header = behind.start(scope(b"abc"))
    assert rec.request_id == "abc" and header is None
    rec, header = behind.start(scope(b"bad id"))
    assert header == rec.request_id.encode() and HEX32.fullmatch(rec.request_id)
    rec, header = behind.start(scope(None))
    assert header == rec.request_id.encode()
    rec, header = RequestLog().start(scope(b"abc"))
    assert header == b"abc"


def test_one_log_line_per_request_without_prompt_or_output(srv, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="ray.serve")
    prompt = [301, 302, 303, 304, 305, 306]
    with client(("10.9.8.7", 1234)) as c:
        r = c.post("/v1/completions", json=completion(prompt=prompt), headers=bearer(API_KEY) | {"X-Request-Id": "log-1"})
        out = r.json()["choices"][0]["token_ids"]
        c.post("/v1/completions", json=completion(), headers={"X-Request-Id": "log-2"})
    lines = [r.getMessage() for r in caplog.records if r.name == "ray.serve.ray_attn.requests"]
    assert len(lines) == 2, lines
    ok, refused = lines
    assert re.fullmatch(r"request log-1 client=10\.9\.8\.7 POST /v1/completions status=200 tokens_in=6 "
                        r"tokens_out=4 cached=\d+ resumed=0 time_ms=\d+\.\d", ok), ok
    assert re.fullmatch(r"request log-2 client=10\.9\.8\.7 POST /v1/completions status=401 tokens_in=0 "
                        r"tokens_out=0 cached=0 resumed=0 time_ms=\d+\.\d", refused), refused
    assert "301" not in ok and str(out) not in ok and "prompt" not in ok

    caplog.clear()
    monkeypatch.setattr(srv.requests, "mode", "full")
    with client() as c:
        out = c.post("/v1/completions", json=completion(prompt=prompt), headers=bearer(API_KEY)).json()
    (line,) = [r.getMessage() for r in caplog.records if r.name == "ray.serve.ray_attn.requests"]
    assert '"prompt":[301,302,303,304,305,306]' in line, line  # the body as sent
    assert f"output=[0:{out['choices'][0]['token_ids']}]" in line, line

    caplog.clear()
    monkeypatch.setattr(srv.requests, "mode", "off")
    with client() as c:
        c.post("/v1/completions", json=completion(), headers=bearer(API_KEY))
    assert not [r for r in caplog.records if r.name == "ray.serve.ray_attn.requests"]


# ------------------------------------------------------------------- the front and resumption
def _request(path: str, body: bytes, headers: list) -> Request:
    read = []

    async def receive():
        read.append(True)
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": [(k.encode(), v.encode()) for k, v in headers], "client": ("10.0.0.9", 5),
             "server": ("x", 80)}
    req = Request(scope, receive)
    req.read = read
    return req


def _front(call=None):
    from ray_attn.serve.ingress import PrefixRoutingIngress
    from ray_attn.serve.schemas import ServeAppConfig

    cfg = ServeAppConfig.model_validate(base_config(api_keys=[API_KEY], resume_requests=True))

    class Handle:  # the replicas' deployment handle: ``remote(routed)`` streams their messages
        def options(self, **_):
            return self

        def remote(self, routed):
            return call(routed)

    return PrefixRoutingIngress.func_or_class(Handle(), block_size=16, max_body_bytes=1 << 20, retry_after_s=1,
                                              resume_requests=True, max_attempts=2,
                                              app_config=cfg.model_dump(mode="json"))


def test_the_front_refuses_without_a_key_before_reading_the_body():
    front = _front()
    req = _request("/v1/completions", b"{}", [])
    resp = asyncio.run(front(req))
    assert resp.status_code == 401 and resp.headers["www-authenticate"] == "Bearer" and req.read == []


def test_a_stream_resumed_on_another_replica_keeps_its_id(srv):
    """The front relays the real app's stream; the first replica dies after its first tokens;
    the second -- the same app, now resuming -- gets the same X-Request-Id from the front and
    names its engine request after it.  The client sees the whole stream once."""
    from ray_attn.serve.app import fastapi_app
    from ray_attn.serve.ingress import run_asgi

    asked = []

    def replicas(routed):
        asked.append(routed)

        async def gen():
            async for m in run_asgi(fastapi_app, routed.scope_for_app(), routed.body):
                yield m
                if len(asked) == 1 and b'"i":' in m.get("body", b""):
                    raise RuntimeError("replica died")  # after the first event that carried tokens
        return gen()

    front = _front(replicas)
    body = json.dumps(completion(max_tokens=6, stream=True)).encode()
    for given in ("resume-me", None):
        asked.clear()
        srv.engine_ids.clear()
        resp = asyncio.run(front(_request("/v1/completions", body, [AUTH, ("content-type", "application/json")]
                                          + ([("x-request-id", given)] if given else []))))
        resp.retry_delay_s = 0.0
        sent = []

        async def send(m):
            sent.append(m)

        asyncio.run(resp(None, None, send))
        ids = [dict(r.scope["headers"])[b"x-request-id"].decode() for r in asked]
        assert len(asked) == 2 and ids[0] == ids[1] and asked[1].resume is not None
        rid = ids[0]
        assert rid == given or (given is None and HEX32.fullmatch(rid))
        assert [a for a, _ in srv.engine_ids] == [rid, rid]  # the lost one, the resumed one
        assert all(e.startswith(f"{rid}-") for _, e in srv.engine_ids)
        # each event opens with its id line for reconnection (relay.py); the data line follows
        events = [json.loads(ev.split("\n")[-1][6:]) for ev in b"".join(m.get("body", b"") for m in sent).decode()
                  .split("\n\n") if ev.split("\n")[-1].startswith("data: {")]
        tokens = [t for e in events for ch in e["choices"] for t in ch["token_ids"]]
        assert len(tokens) == 6 and events[0]["id"] == f"cmpl-{rid}" and {e["id"] for e in events} == {f"cmpl-{rid}"}
        assert events[-1]["choices"][0]["finish_reason"] == "length" and events[0]["model"] == MODEL_ID
