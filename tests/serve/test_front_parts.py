"""The front's parts without Serve: the bounded error body, the body deadline, the admission
counts and their middleware, the config that sizes them.  ``test_front.py`` runs them for real."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.requests import Request

from ray_attn.serve.admission import Admission, AdmissionMiddleware, route_path
from ray_attn.serve.http import MAX_ERRORS, HTTPError, _validation_error, not_taken, read_body, request_failed
from ray_attn.serve.loop import LoopDead, QueueFull
from ray_attn.serve.schemas import GenerateRequest, ServeAppConfig, validation_errors


def body_bytes(resp) -> int:
    return len(resp.body)


# ----------------------------------------------------------------------------- the error body
def unknown_keys(n: int, key) -> list[tuple[str, str]]:
    body = json.dumps({key(i): 0 for i in range(n)})
    with pytest.raises(ValidationError) as e:
        GenerateRequest.model_validate_json(body)
    return validation_errors(e.value)


CASES = {
    "10,000 unknown keys": lambda: unknown_keys(10_000, lambda i: f"k{i}"),
    "long keys": lambda: unknown_keys(100, lambda i: f"{i}" + "x" * 5000),
    "control-character keys": lambda: unknown_keys(100, lambda i: f"{i}" + "\x01" * 2000),
    "non-ASCII keys": lambda: unknown_keys(100, lambda i: f"{i}" + "\U0001f600" * 2000),
    "one huge message": lambda: [("body", "body: " + "y" * 1_000_000)],
}


@pytest.mark.parametrize("exc,field", [(QueueFull("256 running"), "queue"), (LoopDead("rank 1 died"), "replica")])
def test_a_request_the_loop_refused_is_a_retryable_503_naming_why(exc, field):
    """/v1/generate and the OpenAI routes map the loop's refusals through one function: a full
    replica and a dead engine are both 503 + Retry-After, told apart by the field."""
    e = not_taken(exc, {"Retry-After": "2"})
    body = e.body()
    assert e.status == 503 and e.headers == {"Retry-After": "2"}
    assert body["field"] == field and str(exc) in body["detail"] and body["error"]["type"] == "service_unavailable"
    f = request_failed("rank 0: CUDA error", {"Retry-After": "2"})
    assert f.status == 503 and f.body()["field"] == "replica" and "rank 0: CUDA error" in f.body()["detail"]


@pytest.mark.parametrize("case", list(CASES))
def test_error_body_stays_under_8kb_whatever_the_client_sent(case):
    errors = CASES[case]()
    resp = HTTPError(422, errors).response()
    assert body_bytes(resp) < 8192, body_bytes(resp)
    body = json.loads(resp.body)
    assert 1 <= len(body["errors"]) <= MAX_ERRORS
    assert body["field"] == body["errors"][0]["field"] and body["detail"] == body["error"]["message"]
    assert body["detail"].startswith(body["field"][:20])


def test_fastapi_validation_error_gets_our_bounded_body():
    exc = RequestValidationError([{"loc": ("body", f"k{i}"), "msg": "Field required", "type": "missing"}
                                  for i in range(10_000)])
    resp = _validation_error(None, exc)
    body = json.loads(resp.body)
    assert resp.status_code == 422 and body_bytes(resp) < 8192
    assert body["field"] == "body.k0" and body["detail"] == "body.k0: Field required"
    assert len(body["errors"]) == MAX_ERRORS


# ------------------------------------------------------------------------------ body deadline
def fake_request(chunks: list[bytes], then: str = "stall", timeout_s: float | None = None) -> Request:
    """A request whose body arrives as ``chunks`` (more_body set), then stalls or disconnects."""
    queue = list(chunks)

    async def receive():
        if queue:
            return {"type": "http.request", "body": queue.pop(0), "more_body": True}
        if then == "disconnect":
            return {"type": "http.disconnect"}
        await asyncio.Event().wait()  # a client that sends nothing more

    scope = {"type": "http", "method": "POST", "path": "/v1/generate", "headers": [],
             "query_string": b""}
    if timeout_s is not None:
        scope["state"] = {"body_timeout_s": timeout_s}
    return Request(scope, receive)


@pytest.mark.parametrize("chunks", [[], [b'{"prompt_'], [b"{", b'"a"', b":"]])
@pytest.mark.parametrize("where", ["argument", "request state"])
def test_stalled_body_gets_408_with_connection_close(chunks, where):
    req = fake_request(chunks, timeout_s=0.05 if where == "request state" else None)
    kw = {"timeout_s": 0.05} if where == "argument" else {}
    with pytest.raises(HTTPError) as e:
        asyncio.run(asyncio.wait_for(read_body(req, 1 << 20, **kw), 10))  # bounded if no deadline
    assert e.value.status == 408 and e.value.headers == {"Connection": "close"}
    assert e.value.errors[0][0] == "body" and f"{sum(map(len, chunks))} bytes arrived" in e.value.errors[0][1]


def test_client_that_disconnects_mid_body_gets_400_not_a_crash():
    with pytest.raises(HTTPError) as e:
        asyncio.run(read_body(fake_request([b"{"], then="disconnect"), 1 << 20, timeout_s=5))
    assert e.value.status == 400 and "disconnected" in e.value.errors[0][1]


# -------------------------------------------------------------------------- admission counts
@pytest.mark.parametrize("max_conn,per_client", [(1, 1), (5, 2), (12, 4), (8, 8)])
@pytest.mark.parametrize("seed", range(3))
def test_admission_matches_a_reference_count(max_conn, per_client, seed):
    rng = random.Random(seed * 1000 + max_conn * 10 + per_client)
    refusals = []
    gate = Admission(max_conn, per_client, retry_after_s=3, body_timeout_s=1.0, on_refused=refusals.append)
    held: list[str] = []  # the reference: one entry per admitted request
    want_refusals = []
    for _ in range(400):
        if held and rng.random() < 0.45:
            gate.leave(held.pop(rng.randrange(len(held))))
            continue
        client = f"10.0.0.{rng.randrange(4)}"
        want = 429 if held.count(client) >= per_client else 503 if len(held) >= max_conn else None
        refusal = gate.enter(client)
        assert (refusal.status if refusal else None) == want
        want_refusals += [want] if want else []
        if refusal is None:
            held.append(client)
        else:
            assert refusal.headers["Retry-After"] == "3" and refusal.errors[0][0] in ("client", "connections")
        assert gate.stats()["connections_open"] == len(held)
        assert gate.stats()["clients_open"] == len(set(held))
    assert refusals == want_refusals  # each refusal reaches the metric once
    stats = gate.stats()
    assert (stats["requests_rejected_client"], stats["requests_rejected_connections"]) == (
        want_refusals.count(429), want_refusals.count(503))
    for client in held:
        gate.leave(client)
    assert gate.stats()["connections_open"] == 0 and gate._by_client == {}, "no memory per past client"


def test_route_path_under_a_route_prefix():
    assert route_path({"path": "/plain/health", "root_path": "/plain"}) == "/health"
    assert route_path({"path": "/health", "root_path": "/plain"}) == "/health"
    assert route_path({"path": "/health", "root_path": ""}) == "/health"
    assert route_path({"path": "/plain", "root_path": "/plain"}) == "/"


# ------------------------------------------------------------------------------ the middleware
def run_asgi(path, client="10.1.1.1"):
    """(scope, receive, send, sent) of one POST to ``path`` from ``client``; ``sent`` collects
    what ``mw`` answers."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "headers": [],
             "query_string": b"", "client": (client, 1234)}
    return scope, receive, send, sent


def test_middleware_counts_until_the_response_ends_and_always_releases():
    gate = Admission(2, 2, retry_after_s=4, body_timeout_s=7.0)
    seen = {}

    async def scenario():
        gate_open = asyncio.Event()
        finish = asyncio.Event()

        async def streaming_app(scope, receive, send):
            seen["timeout"] = scope["state"]["body_timeout_s"]
            await send({"type": "http.response.start", "status": 200, "headers": []})
            gate_open.set()
            await finish.wait()  # the handler has returned; the stream goes on
            await send({"type": "http.response.body", "body": b"x"})

        mw = AdmissionMiddleware(streaming_app, lambda: gate)
        scope, receive, send, _ = run_asgi("/v1/generate")
        task = asyncio.create_task(mw(scope, receive, send))
        await gate_open.wait()
        seen["during"] = gate.stats()["connections_open"]
        finish.set()
        await task
        seen["after"] = gate.stats()["connections_open"]

        async def failing_app(scope, receive, send):
            raise RuntimeError("boom")

        mw = AdmissionMiddleware(failing_app, lambda: gate)
        with pytest.raises(RuntimeError):
            await mw(*run_asgi("/v1/generate")[:3])
        seen["after_error"] = gate.stats()["connections_open"]

        async def hanging_app(scope, receive, send):
            await asyncio.Event().wait()

        mw = AdmissionMiddleware(hanging_app, lambda: gate)
        task = asyncio.create_task(mw(*run_asgi("/v1/generate")[:3]))
        await asyncio.sleep(0)
        seen["hanging"] = gate.stats()["connections_open"]
        task.cancel()  # what Serve does when the client goes away
        with pytest.raises(asyncio.CancelledError):
            await task
        seen["after_cancel"] = gate.stats()["connections_open"]

    asyncio.run(scenario())
    assert seen == {"timeout": 7.0, "during": 1, "after": 0, "after_error": 0, "hanging": 1,
                    "after_cancel": 0}


@pytest.mark.parametrize("path,counted", [("/health", False), ("/stats", False),
                                          ("/v1/generate", True), ("/v1/models", True)])
def test_health_and_stats_bypass_the_bounds(path, counted):
    gate = Admission(1, 1, retry_after_s=4, body_timeout_s=7.0)
    assert gate.enter("10.9.9.9") is None  # the replica is full

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    mw = AdmissionMiddleware(app, lambda: gate)
    scope, receive, send, sent = run_asgi(path)
    asyncio.run(mw(scope, receive, send))
    status = sent[0]["status"]
    assert status == (503 if counted else 200)
    if counted:
        headers = dict(sent[0]["headers"])
        assert headers[b"retry-after"] == b"4" and headers[b"connection"] == b"close"
        assert json.loads(sent[1]["body"])["field"] == "connections"


@pytest.mark.parametrize("status,has_header,want", [(503, False, b"4"), (429, False, b"4"),
                                                    (503, True, b"9"), (500, False, None)])
def test_every_503_and_429_gets_retry_after(status, has_header, want):
    gate = Admission(4, 4, retry_after_s=4, body_timeout_s=7.0)

    async def app(scope, receive, send):
        headers = [(b"retry-after", b"9")] if has_header else []
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"{}"})

    mw = AdmissionMiddleware(app, lambda: gate)
    for path in ("/health", "/v1/generate"):
        scope, receive, send, sent = run_asgi(path)
        asyncio.run(mw(scope, receive, send))
        values = [v for k, v in sent[0]["headers"] if k == b"retry-after"]
        assert values == ([want] if want else []), (path, values)


# ---------------------------------------------------------------------------------- the config
def config(**kw) -> ServeAppConfig:
    return ServeAppConfig.model_validate(dict(executor="in_process", engine=dict(
        ServeAppConfig().engine.model_dump(mode="json"), parallel={"tensor_parallel_size": 1,
                                                                   "device": "cpu"}), **kw))


@pytest.mark.parametrize("kw,field", [
    (dict(max_connections=10), "max_connections"),                       # below max_in_flight = 96
    (dict(max_connections=100, max_requests_per_client=101), "max_requests_per_client"),
    (dict(max_requests_per_client=0), "max_requests_per_client"),
    (dict(body_timeout_s=0), "body_timeout_s"),
    (dict(body_timeout_s=float("inf")), "body_timeout_s"),
])
def test_bad_front_config_is_refused_naming_the_field(kw, field):
    with pytest.raises(ValidationError) as e:
        config(**kw)
    assert field in str(e.value)


@pytest.mark.parametrize("kw,conns,per_client", [
    ({}, 192, 96),
    (dict(max_connections=100), 100, 50),
    (dict(max_connections=100, max_requests_per_client=100), 100, 100),
    (dict(max_queue_depth=8), 80, 40),
])
def test_serve_slots_exceed_our_bounds(kw, conns, per_client):
    from ray_attn.serve.app import deployment_options

    cfg = config(**kw)
    assert (cfg.connection_limit, cfg.client_limit) == (conns, per_client)
    opts = deployment_options(cfg)
    # Our bounds bite first: Serve's slots hold every request we admit plus control_headroom
    # for /health, /stats and requests being refused.
    assert opts["max_ongoing_requests"] == conns + cfg.control_headroom > conns
    assert opts["backpressure_config"] == {"retry_after_s": cfg.retry_after_s}


@pytest.mark.parametrize("name", ["serve_config.yaml", "serve_config.gpu.yaml"])
def test_shipped_configs_set_the_front_knobs(name):
    from pathlib import Path

    import yaml
    from ray.serve.config import HTTPOptions

    data = yaml.safe_load((Path(__file__).resolve().parents[2] / "deploy" / name).read_text())
    http = HTTPOptions(**data["http_options"])  # Serve accepts every key
    assert 0 < http.keep_alive_timeout_s < 90 and http.request_timeout_s
    (app,) = data["applications"]
    cfg = ServeAppConfig.model_validate(app["args"])
    for knob in ("body_timeout_s", "max_connections", "max_requests_per_client"):
        assert knob in app["args"], knob
    assert cfg.max_in_flight <= cfg.connection_limit and cfg.client_limit <= cfg.connection_limit
