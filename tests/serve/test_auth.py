"""API keys and the admin scope through the app itself (``tests/serve/app_harness.py``: every
route and middleware of the Serve app on a real in-process engine, no Ray).

What a request without a valid key must never do is checked where it would happen: the engine
loop's counts (nothing queued or computed), the admission gate (never entered), the body (never
read), and -- over a socket, through the HTTP parser Serve's proxy runs -- what the client gets.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import logging
import os
import socket

import pytest
from pydantic import ValidationError

from ray_attn.serve.auth import KeyRing, bearer, resolve_under
from ray_attn.serve.http import HTTPError
from ray_attn.serve.schemas import ServeAppConfig
from tests.serve.conftest import REPO
from tests.serve.app_harness import (ADMIN_KEY, API_KEY, OTHER_KEY, asgi_call, client, completion,
                                     engine_counts, in_replica, keyed_server, raw_request, uvicorn_url)

__all__ = ["in_replica"]  # the fixture, imported for pytest

BASIC = "Basic " + base64.b64encode(f"user:{API_KEY}".encode()).decode()
# Every way of not holding a key, as an ASGI server may hand it to the app.  (Over HTTP/1.1 a
# trailing space never arrives: the parser strips it, see the socket test below.)
BAD = {"no key": None, "a wrong key": "Bearer sk-wrong-but-plausible-000000",
       "the key with a trailing space": f"Bearer {API_KEY} ", "the key after two spaces": f"Bearer  {API_KEY}",
       "the key, Basic scheme": BASIC, "the key without a scheme": API_KEY,
       "a 1 MB header": "Bearer " + "k" * (1 << 20)}


def _routes(prefix_ok=lambda p: p != "/health" and not p.startswith("/admin")):
    """Every (method, path) the app serves, but /health and the admin scope -- read from the
    app, so that a route added later is covered too."""
    from ray_attn.serve.app import fastapi_app

    def walk(routes):  # FastAPI keeps an included router's routes under one node of its own
        for r in routes:
            if hasattr(r, "original_router"):
                yield from walk(r.original_router.routes)
            else:
                yield r

    out = []
    for r in walk(fastapi_app.routes):
        for m in sorted(getattr(r, "methods", None) or ()):
            if m != "HEAD" and prefix_ok(r.path):
                out.append((m, r.path))
    return out + [("GET", "/no/such/path"), ("GET", "/v1/models/")]


ROUTES = _routes()


@pytest.fixture
def keyed(in_replica, monkeypatch):
    """The shared keyed server, with its admission gate watched: ``entered`` counts requests it
    was asked to count."""
    srv = in_replica(keyed_server())
    entered = []
    enter = srv.admission.enter
    monkeypatch.setattr(srv.admission, "enter", lambda client_addr: entered.append(client_addr) or enter(client_addr))
    srv.entered = entered
    return srv


def body_for(path: str) -> bytes:
    return json.dumps(completion() | {"prompt_token_ids": [1, 2, 3], "messages": [{"role": "user", "content": "hi"}]}
                      if path.startswith("/v1") else {"prompt": "hi"}).encode()


def test_the_route_list_is_read_from_the_app():
    paths = {p for _, p in ROUTES}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/generate", "/v1/models", "/tokenize", "/stats",
            "/metrics", "/openapi.json", "/docs"} <= paths


@pytest.mark.parametrize("how", list(BAD))
def test_every_route_but_health_answers_401_and_nothing_runs(keyed, how):
    """Each bad credential on every route: 401, our error body, WWW-Authenticate: Bearer, a
    request id -- and the body unread, admission never entered, the engine untouched."""
    before = engine_counts(keyed)
    headers = [] if BAD[how] is None else [("authorization", BAD[how])]
    for method, path in ROUTES:
        a = asgi_call(method, path, headers + [("content-type", "application/json")], body_for(path))
        assert a.status == 401, (method, path, a.status, a.body[:200])
        assert a.headers["www-authenticate"] == "Bearer"
        err = a.json()
        assert err["field"] == "authorization" and err["error"]["code"] == 401 and err["detail"].startswith("authorization:")
        assert len(a.headers["x-request-id"]) == 32
        assert not a.body_read, (method, path)
    assert keyed.entered == []
    assert engine_counts(keyed) == before


def test_a_valid_key_opens_every_v1_route_and_either_key_of_a_rotation_works(keyed):
    before = engine_counts(keyed)["finished"]
    with client() as c:
        for key in (API_KEY, OTHER_KEY):
            auth = {"Authorization": f"Bearer {key}"}
            assert c.get("/v1/models", headers=auth).status_code == 200
            r = c.post("/v1/completions", json=completion(), headers=auth)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
            assert c.post("/v1/generate", json={"prompt_token_ids": [1, 2, 3], "max_tokens": 2},
                          headers={"authorization": f"bearer {key}"}).status_code == 200  # the scheme: any case
            # past the key check: this server has no tokenizer, so chat is a 400 naming messages
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, headers=auth)
            assert r.status_code == 400 and r.json()["field"] == "messages"
    assert engine_counts(keyed)["finished"] == before + 4
    assert len(keyed.entered) == 8


def test_health_stays_open_and_metrics_are_keyed_unless_public(keyed, monkeypatch):
    with client() as c:
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 401 and c.get("/stats").status_code == 401
        auth = {"Authorization": f"Bearer {API_KEY}"}
        assert c.get("/metrics", headers=auth).status_code == 200 and c.get("/stats", headers=auth).status_code == 200
        monkeypatch.setattr(keyed.auth, "public_metrics", True)
        assert c.get("/metrics").status_code == 200 and c.get("/stats").status_code == 200
        assert c.get("/v1/models").status_code == 401  # only those two


def test_without_keys_the_server_stays_open_as_before(in_replica):
    from tests.serve.app_harness import served_app

    srv = in_replica(served_app())
    assert not srv.auth.api.configured
    with client() as c:
        assert c.get("/v1/models").status_code == 200 and c.get("/stats").status_code == 200
        assert c.post("/admin/reload_api_keys").status_code == 404  # and no admin scope


def test_admin_routes_need_the_admin_key_and_are_off_without_one(keyed, monkeypatch):
    with client() as c:
        for key in (None, API_KEY, OTHER_KEY, "x" + ADMIN_KEY):
            r = c.post("/admin/reload_api_keys", headers={"Authorization": f"Bearer {key}"} if key else {})
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", key
        r = c.post("/admin/reload_api_keys", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert r.status_code == 200 and r.json() == {"api_keys": 2, "admin_api_keys": 1}
        assert c.get("/v1/models", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).status_code == 401
        monkeypatch.setattr(keyed.auth, "admin", KeyRing("admin_api_key"))  # none configured
        r = c.post("/admin/reload_api_keys", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert r.status_code == 404 and r.json()["field"] == "path"


# --------------------------------------------------------------------------------- over a socket
def test_over_a_socket_what_a_client_gets(keyed):
    """Through uvicorn with the parser Serve's proxy uses: each bad credential is our 401 and
    runs nothing; a 1 MB header reaches the app (httptools passes it) and is refused the same;
    a trailing space is stripped by the parser (RFC 9110 5.5) so the key arrives exact, while a
    trailing no-break space does not; and a 401 comes before the body, which is never awaited."""
    before = engine_counts(keyed)
    body = json.dumps(completion()).encode()
    with uvicorn_url() as (_, port):
        def post(auth: bytes | None, send_body: bytes = body, length: int | None = None):
            head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d" % (len(send_body) if length is None else length))
            if auth is not None:
                head += b"\r\nAuthorization: " + auth
            return raw_request(port, head, send_body)

        for auth in (None, b"Bearer sk-wrong", BASIC.encode(), API_KEY.encode(), b"Bearer " + API_KEY.encode() + b"\xa0",
                     b"Bearer " + b"k" * (1 << 20)):
            status, headers, out = post(auth)
            if auth and len(auth) > 1 << 20 and importlib.util.find_spec("httptools") is None:
                assert status == 400  # h11 refuses a 1 MB header itself, in plain text
                continue
            err = json.loads(out)
            assert status == 401 and headers["www-authenticate"] == "Bearer" and err["field"] == "authorization", \
                auth[:40] if auth else auth
            assert "x-request-id" in headers
        # headers and 10 bytes of a 1,000,000-byte body: the 401 does not wait for the rest
        status, _, _ = post(None, b'{"prompt":', length=1_000_000)
        assert status == 401
        assert engine_counts(keyed) == before and keyed.entered == []
        status, _, out = post(b"Bearer " + API_KEY.encode() + b" ")
        assert status == 200 and json.loads(out)["usage"]["completion_tokens"] == 4
        status, _, _ = post(b"Bearer " + API_KEY.encode())
        assert status == 200
        with socket.create_connection(("127.0.0.1", port)) as s:  # /health: open, also while refusing
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(100).startswith(b"HTTP/1.1 200")
    assert engine_counts(keyed)["finished"] == before["finished"] + 2


# --------------------------------------------------------------------------- never shown anywhere
def test_no_key_appears_in_logs_metrics_or_error_bodies(keyed, caplog, monkeypatch):
    """Good keys, wrong keys and an admin key sent every way, with full request logs on and the
    uvicorn access log too: no key, and no wrong key either, is in any log record, in /metrics,
    /stats or any answer."""
    wrong = "sk-wrong-marker-7c1e93"
    sent = [API_KEY, OTHER_KEY, ADMIN_KEY, wrong]
    monkeypatch.setattr(keyed.requests, "mode", "full")
    caplog.set_level(logging.DEBUG)
    bodies = []
    with client() as c:
        for key in sent:
            for h in ({"Authorization": f"Bearer {key}"}, {"Authorization": f"Basic {key}"},
                      {"Authorization": f"Bearer {key} "}, {"Authorization": key}):
                for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("POST", "/admin/reload_api_keys"),
                                     ("GET", "/stats"), ("POST", "/tokenize")):
                    r = c.request(method, path, json=completion(), headers=h)
                    bodies.append(r.text + json.dumps(dict(r.headers)))
        auth = {"Authorization": f"Bearer {API_KEY}"}
        bodies += [c.get("/metrics", headers=auth).text, c.get("/stats", headers=auth).text]
    import uvicorn.config  # noqa: F401 - uvicorn's access logger, captured like the rest

    with uvicorn_url() as (_, port):
        for key in sent:
            raw_request(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key.encode())
    logged = caplog.text + "".join(f"{r.getMessage()} {r.args!r}" for r in caplog.records)
    assert "status=401" in logged and "status=200" in logged  # the request log was captured
    for key in sent:
        for where, text in (("logs", logged), ("answers", "".join(bodies))):
            assert key not in text and key[:12] not in text, (key, where)


def test_the_config_never_shows_a_key():
    cfg = ServeAppConfig(api_keys=[API_KEY], admin_api_keys=[ADMIN_KEY])
    assert API_KEY not in repr(cfg) and ADMIN_KEY not in str(cfg)
    assert ServeAppConfig.model_validate(cfg.model_dump(mode="json")).api_keys[0].get_secret_value() == API_KEY
    for bad in ({"api_keys": [API_KEY + " x"]}, {"api_key": API_KEY}, {"admin_api_keys": [API_KEY, f"é{ADMIN_KEY}"]},
                {"api_keys": API_KEY}):
        with pytest.raises(ValidationError) as e:
            ServeAppConfig.model_validate(bad)
        assert API_KEY not in str(e.value) and ADMIN_KEY not in str(e.value), str(e.value)
    with pytest.raises(ValidationError, match=r"admin_api_keys\[1\]: a key may hold only visible ASCII"):
        ServeAppConfig.model_validate({"admin_api_keys": [API_KEY, f"é{ADMIN_KEY}"]})


# ------------------------------------------------------------------------------------ key sources
def test_keys_from_the_environment_and_a_file_rotate_without_a_restart(tmp_path, monkeypatch, caplog):
    now = [0.0]
    path = tmp_path / "keys"
    path.write_text(f"# the keys\n{API_KEY}\n\n")
    monkeypatch.setenv("TEST_KEYS", f" {OTHER_KEY} ,,")
    ring = KeyRing("api_key", env="TEST_KEYS", file=str(path), reload_every_s=1.0, clock=lambda: now[0])
    assert ring.configured and ring.accepts(API_KEY.encode()) and ring.accepts(OTHER_KEY.encode())
    path.write_text("sk-new-key-after-rotation-1\n")
    assert ring.accepts(API_KEY.encode())  # not re-read within the second
    now[0] = 1.5
    assert not ring.accepts(API_KEY.encode()) and ring.accepts(b"sk-new-key-after-rotation-1")
    assert ring.accepts(OTHER_KEY.encode())  # the environment's stays
    caplog.set_level(logging.INFO)
    os.remove(path)
    now[0] = 3.0
    assert not ring.accepts(b"sk-new-key-after-rotation-1")  # gone: none of its keys, never open
    assert "api_key_file" in caplog.text and "sk-new-key" not in caplog.text
    with pytest.raises(ValueError, match="api_key_file: cannot read"):
        KeyRing("api_key", file=str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.write_text("# no key yet\n")
    ring = KeyRing("api_key", file=str(empty))
    assert ring.configured and not ring.accepts(b"") and not ring.accepts(None)  # an empty file refuses all
    (tmp_path / "bad").write_text(f"{API_KEY} trailing words\n")
    with pytest.raises(ValueError, match="line 1") as e:
        KeyRing("api_key", file=str(tmp_path / "bad"))
    assert API_KEY not in str(e.value)


def test_a_key_file_through_the_app_config(tmp_path, in_replica):
    from tests.serve.app_harness import served_app

    path = tmp_path / "keys"
    path.write_text(f"{API_KEY}\n")
    srv = in_replica(served_app(api_key_file=str(path), admin_api_keys=[ADMIN_KEY]))
    with client() as c:
        assert c.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
        path.write_text(f"{OTHER_KEY}\n")
        r = c.post("/admin/reload_api_keys", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert r.json()["api_keys"] == 1
        assert c.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 401
        assert c.get("/v1/models", headers={"Authorization": f"Bearer {OTHER_KEY}"}).status_code == 200
    assert srv.auth.api.file == str(path)


def test_bearer_takes_the_credential_byte_for_byte():
    def scope(*values):
        return {"headers": [(b"authorization", v) for v in values]}

    assert bearer(scope(b"Bearer abc")) == b"abc" and bearer(scope(b"BEARER abc")) == b"abc"
    assert bearer(scope(b"Bearer abc ")) == b"abc " and bearer(scope(b"Bearer  abc")) == b" abc"
    assert bearer(scope()) is None and bearer(scope(b"Basic abc")) is None and bearer(scope(b"abc")) is None
    assert bearer(scope(b"Bearer abc", b"Bearer abc")) is None  # two headers: neither counts
    assert bearer(scope(b"Bearer " + b"k" * 10_000)) is None


# ------------------------------------------------------------------------------ the path rule
def test_resolve_under_refuses_dotdot_and_symlink_escapes(tmp_path):
    root, outside = tmp_path / "adapters", tmp_path / "secret"
    (root / "lora-a").mkdir(parents=True)
    outside.mkdir()
    (outside / "key.pem").write_text("x")
    (root / "lora-a" / "adapter.safetensors").write_text("w")
    os.symlink(outside, root / "escape")
    os.symlink(outside / "key.pem", root / "lora-a" / "file-escape")
    os.symlink(root / "lora-a", root / "alias")
    assert resolve_under(str(root), "lora-a") == root / "lora-a"
    assert resolve_under(str(root), str(root / "lora-a" / "adapter.safetensors")) == root / "lora-a" / "adapter.safetensors"
    assert resolve_under(str(root), "alias/adapter.safetensors") == root / "lora-a" / "adapter.safetensors"
    assert resolve_under(str(root), "not-yet-there") == root / "not-yet-there"  # a load says "not found"
    for bad in ("../secret", "lora-a/../../secret", "lora-a/../lora-a", "escape", "escape/key.pem",
                "lora-a/file-escape", str(outside / "key.pem"), "/etc/passwd", ".", "", "a\x00b"):
        with pytest.raises(HTTPError) as e:
            resolve_under(str(root), bad, "adapter_path")
        assert e.value.status == 400 and e.value.errors[0][0] == "adapter_path", bad
    # the root itself behind a symlink: what it points to is the root
    os.symlink(root, tmp_path / "root-link")
    assert resolve_under(str(tmp_path / "root-link"), "lora-a") == root / "lora-a"
    with pytest.raises(HTTPError):
        resolve_under(str(tmp_path / "root-link"), "escape")


def test_admin_paths_need_a_configured_root(tmp_path):
    cfg = ServeAppConfig(admin_api_keys=[ADMIN_KEY], admin_root=str(tmp_path))
    from ray_attn.serve.auth import Auth

    (tmp_path / "x").mkdir()
    assert Auth.from_config(cfg).admin_path("x") == tmp_path / "x"
    with pytest.raises(HTTPError, match="admin_root is not configured"):
        Auth.from_config(ServeAppConfig(admin_api_keys=[ADMIN_KEY])).admin_path("x")


def test_cli_flags_as_vllms(tmp_path):
    import argparse

    from ray_attn.serve.cli import add_arguments, keyed, serve_config

    p = argparse.ArgumentParser()
    add_arguments(p)
    yaml = str(REPO / "deploy" / "serve_config.yaml")  # its random engine: no model to load
    cfg = serve_config(p.parse_args(["--config", yaml, "--api-key", API_KEY, "--api-key", OTHER_KEY, "--admin-api-key", ADMIN_KEY,
                                     "--disable-log-requests", "--public-metrics",
                                     "--otlp-traces-endpoint", "http://127.0.0.1:4318", "--api-server-count", "4"]))
    assert [k.get_secret_value() for k in cfg.api_keys] == [API_KEY, OTHER_KEY] and keyed(cfg)
    assert cfg.api_server_count == 4
    assert cfg.admin_api_keys[0].get_secret_value() == ADMIN_KEY and cfg.public_metrics
    assert cfg.log_requests == "off" and cfg.otlp_traces_endpoint == "http://127.0.0.1:4318"
    plain = serve_config(p.parse_args(["--config", yaml, "--log-requests", "full"]))
    assert plain.log_requests == "full" and plain.api_keys == [] and plain.api_server_count == 1
    with pytest.raises(ValueError, match="api_server_count"):
        serve_config(p.parse_args(["--config", yaml, "--api-server-count", "0"]))


def test_api_server_count_outside_a_replica_starts_nothing():
    """The keeper of extra proxies (serve/api_servers.py) runs only in a Serve replica that asks
    for more than one: a test's app or a script gets None, and starts no thread."""
    import threading

    from ray_attn.serve.api_servers import keep_from_replica

    before = threading.active_count()
    assert keep_from_replica(1) is None and keep_from_replica(4) is None
    assert threading.active_count() == before
