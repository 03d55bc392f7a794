"""The API-key filter in Serve's HTTP proxy (``ray_attn/serve/proxy_auth.py``), as pure ASGI:
a stand-in for the proxy's app behind it (with Serve's route table), a dict for Ray's internal
KV, the entries a replica's :class:`Auth` publishes.  Through the real proxy:
``tests/serve/test_exposed_serve.py``."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from ray_attn.serve import proxy_auth as pa
from ray_attn.serve.auth import Auth, KeyRing, unauthorized
from tests.serve.app_harness import ADMIN_KEY, API_KEY, OTHER_KEY

WRONG = "sk-proxy-wrong-9f1c"


class FakeKV:
    def __init__(self):
        self.data, self.reads = {}, 0

    def put(self, key, value):
        self.data[key] = value

    def delete(self, key):
        self.data.pop(key, None)

    def entries(self):
        self.reads += 1
        return list(self.data.items())


class Router:
    """Serve's ProxyRouter as the filter reads it: routes longest first, each to an app."""

    def __init__(self, routes: dict):
        self.route_info = {r: SimpleNamespace(app_name=a) for r, a in routes.items()}
        self.sorted_routes = sorted(routes, key=len, reverse=True)


class ProxyApp:
    """What sits behind the filter in the proxy: counts what reached it and answers 200."""

    def __init__(self, router):
        self.proxy_router, self.seen = router, []

    async def __call__(self, scope, receive, send):
        self.seen.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


class RequestIdLayer:
    """Serve's RequestIdMiddleware sits between the filter and the proxy's app, and keeps the app
    it wraps as ``_app``."""

    def __init__(self, app):
        self._app = app

    async def __call__(self, scope, receive, send):
        await self._app(scope, receive, send)


def auth(keys=(), admin=()) -> Auth:
    return Auth(KeyRing("api_key", keys), KeyRing("admin_api_key", admin))


def publish(kv, app, a, replica="r1", stamp=None):
    e = pa.entry_of(a)
    if stamp is not None:
        e["stamp"] = stamp
    kv.put((pa.PREFIX + f"{app}/{replica}").encode(), json.dumps(e).encode())


def call(mw, path, key=None, scheme="Bearer", method="POST", extra=()):
    headers = [(b"authorization", f"{scheme} {key}".encode())] if key is not None else []
    scope = {"type": "http", "method": method, "path": path, "headers": headers + list(extra),
             "client": ("127.0.0.9", 5000)}
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(msg):
        sent.append(msg)

    asyncio.run(mw(scope, receive, send))
    start = sent[0]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, body


@pytest.fixture
def proxy():
    kv = FakeKV()
    inner = ProxyApp(Router({"/": "main", "/keyed": "keyed", "/other": "theirs"}))
    mw = pa.ProxyAuthMiddleware(RequestIdLayer(inner), pa.Table(kv))
    publish(kv, "keyed", auth([API_KEY, OTHER_KEY], [ADMIN_KEY]))
    publish(kv, "main", auth())
    read(mw.table)
    return SimpleNamespace(kv=kv, inner=inner, mw=mw)


def read(table):
    """A read of the table, as the proxy's thread makes it, waited for."""
    table.read_at = float("-inf")
    table.refresh_soon(0).result(timeout=10)


@pytest.mark.parametrize("how", ["none", "wrong", "trailing space", "basic", "admin key", "1 MB"])
def test_a_keyed_apps_v1_routes_refuse_a_bad_key_in_the_proxy(proxy, how):
    key, scheme = {"none": (None, ""), "wrong": (WRONG, "Bearer"), "trailing space": (API_KEY + " ", "Bearer"),
                   "basic": (API_KEY, "Basic"), "admin key": (ADMIN_KEY, "Bearer"),
                   "1 MB": ("k" * (1 << 20), "Bearer")}[how]
    status, headers, body = call(proxy.mw, "/keyed/v1/chat/completions", key, scheme,
                                 extra=[(b"x-request-id", b"rid-7")])
    assert status == 401 and headers["www-authenticate"] == "Bearer" and headers["x-request-id"] == "rid-7"
    err = json.loads(body)
    assert err["field"] == "authorization" and {"error", "detail"} <= err.keys()
    # byte for byte the app's own refusal of that credential (the proxy builds its two once)
    app_says = unauthorized("API", None if how in ("none", "basic", "1 MB") else b"given").response()
    assert body == app_says.body and headers["content-length"] == str(len(app_says.body))
    assert proxy.inner.seen == []  # nothing reached the replica
    for k in (API_KEY, OTHER_KEY, ADMIN_KEY, WRONG):
        assert k.encode() not in body and k not in json.dumps(headers)


def test_either_key_of_a_rotation_passes_and_only_to_its_own_app(proxy):
    for key in (API_KEY, OTHER_KEY):
        assert call(proxy.mw, "/keyed/v1/completions", key)[0] == 200
    # the open app, another app's paths, paths outside /v1, Serve's own and the admin-scope
    # adapter routes: the app (or Serve) decides, never the proxy
    for path in ("/v1/completions", "/other/v1/completions", "/keyed/health", "/keyed/metrics",
                 "/keyed/tokenize", "/-/healthz", "/keyed/v1/load_lora_adapter", "/keyedx/v1/models"):
        assert call(proxy.mw, path)[0] == 200, path
    assert proxy.inner.seen.count("/keyed/v1/completions") == 2


def test_what_the_filter_cannot_judge_goes_through(proxy):
    # an app redeployed without keys, seen while one old keyed replica is still published
    publish(proxy.kv, "keyed", auth(), replica="r2")
    read(proxy.mw.table)
    assert call(proxy.mw, "/keyed/v1/completions")[0] == 200
    # entries gone stale (their replicas died): nothing to judge by
    kv = FakeKV()
    publish(kv, "keyed", auth([API_KEY]), stamp=time.time() - pa.STALE_AFTER_S - 1)
    mw = pa.ProxyAuthMiddleware(ProxyApp(Router({"/keyed": "keyed"})), pa.Table(kv))
    read(mw.table)
    assert call(mw, "/keyed/v1/completions")[0] == 200
    # no route table found (Serve's internals moved): refuse nothing
    kv = FakeKV()
    publish(kv, "keyed", auth([API_KEY]))
    bare = ProxyApp(None)
    del bare.proxy_router
    mw = pa.ProxyAuthMiddleware(bare, pa.Table(kv))
    read(mw.table)
    assert call(mw, "/keyed/v1/completions")[0] == 200
    # a garbled entry is skipped, the others still count
    proxy.kv.put((pa.PREFIX + "keyed/r9").encode(), b"{not json")
    proxy.kv.delete((pa.PREFIX + "keyed/r2").encode())
    read(proxy.mw.table)
    assert call(proxy.mw, "/keyed/v1/completions")[0] == 401


def test_a_key_rotated_in_is_taken_by_the_next_read_and_reads_are_so_often(proxy):
    NEW = "sk-rotated-in-31d8"
    assert call(proxy.mw, "/keyed/v1/completions", key=API_KEY)[0] == 200
    reads = proxy.kv.reads
    for _ in range(20):  # a flood on a fresh table: refused, and no read per request
        assert call(proxy.mw, "/keyed/v1/completions", key=WRONG)[0] == 401
    assert proxy.kv.reads == reads
    publish(proxy.kv, "keyed", auth([API_KEY, NEW]))
    proxy.mw.table.read_at -= pa.REFRESH_EVERY_S  # a second later: the next request starts a read
    call(proxy.mw, "/keyed/v1/completions", key=API_KEY)
    proxy.mw.table._pool.shutdown(wait=True)
    assert proxy.kv.reads == reads + 1
    assert call(proxy.mw, "/keyed/v1/completions", key=NEW)[0] == 200
    # a table not read for TRUSTED_FOR_S (the GCS away): the app judges, not the proxy
    proxy.mw.table.read_at -= pa.TRUSTED_FOR_S
    proxy.mw.table._reading = True  # a read hangs
    assert call(proxy.mw, "/keyed/v1/completions", key=WRONG)[0] == 200


def test_no_request_waits_for_a_read_that_hangs():
    """The GCS away (restarting), or the proxy's first requests: a read blocks.  Requests go on
    meanwhile, to the app's check."""
    import threading

    gate = threading.Event()

    class HangingKV(FakeKV):
        def entries(self):
            gate.wait(10)
            return super().entries()

    kv = HangingKV()
    publish(kv, "keyed", auth([API_KEY]))
    mw = pa.ProxyAuthMiddleware(ProxyApp(Router({"/keyed": "keyed"})), pa.Table(kv))
    t0 = time.perf_counter()
    for _ in range(5):
        assert call(mw, "/keyed/v1/completions", key=WRONG)[0] == 200  # not judged: the app refuses it
    assert time.perf_counter() - t0 < 5
    gate.set()
    mw.table._pool.shutdown(wait=True)
    assert call(mw, "/keyed/v1/completions", key=WRONG)[0] == 401


def test_the_publisher_renews_its_entry_and_removes_it_on_close():
    kv = FakeKV()
    a = auth([API_KEY])
    pub = pa.Publisher("keyed/r1", lambda: a, every_s=0.05, kv=kv)
    (value,) = kv.data.values()
    e = json.loads(value)
    assert not e["open"] and e["digests"] == [pa.digest(API_KEY.encode())]
    assert API_KEY not in value.decode()  # digests only
    first = e["stamp"]
    deadline = time.time() + 5
    while json.loads(kv.data[b"ray_attn/proxy_auth/keyed/r1"])["stamp"] == first and time.time() < deadline:
        time.sleep(0.02)
    assert json.loads(kv.data[b"ray_attn/proxy_auth/keyed/r1"])["stamp"] > first
    pub.close()
    assert kv.data == {}
    assert pa.publish_from_replica(lambda: a) is None  # outside a Serve replica: nothing


@pytest.mark.parametrize("front", ["LLMServer", "PrefixRoutingIngress"])
def test_a_stopped_front_takes_its_entry_out(front):
    # Serve calls __del__ when it stops a replica: the entry must go then, not when its stamp is stale
    from ray_attn.serve import app, ingress

    cls = (app.LLMServer if front == "LLMServer" else ingress.PrefixRoutingIngress).func_or_class
    kv = FakeKV()
    obj = cls.__new__(cls)
    obj.proxy_auth = pa.Publisher("keyed/r1", lambda: auth([API_KEY]), every_s=60, kv=kv)
    assert kv.data
    done = obj.__del__()  # Serve's ingress wrapper (LLMServer's) makes it a coroutine
    if asyncio.iscoroutine(done):
        asyncio.run(done)
    assert kv.data == {}
