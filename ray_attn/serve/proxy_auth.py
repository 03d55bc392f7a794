"""Requests without a valid API key refused in Serve's HTTP proxy, before they cost a replica call.

Why: the app's own check (``auth.py``) runs in the replica (or the front).  A request reaching it
has already been parsed by the proxy, routed and sent to the replica over an actor call; its 401
then streams back the same way.  In a flood of unkeyed requests that round trip is most of the
work, and every keyed request waits behind it in the proxy's one event loop
(``scripts/hostile_burst.py --api-key``).  Refused in the proxy, a flooding request costs one
header lookup and one SHA-256.

How:
- The app's ingress (its replicas, or the prefix-routing front) *publishes* what the proxy needs
  to Ray's internal KV, under ``ray_attn/proxy_auth/<app>/<replica>``: the SHA-256 digests of its
  API keys (never a key), and a wall-clock stamp, renewed every ``PUBLISH_EVERY_S``.
  An app without keys publishes an entry without digests: open.
- The proxy's middleware (installed through Serve's
  ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=ray_attn.serve.proxy_auth:proxy_middlewares``,
  which ``ray-attn serve`` sets) reads the table at most every ``REFRESH_EVERY_S``, in a thread.
- It refuses only what the app's own check would refuse, and lets everything else through to
  that check: it acts on ``/v1/...`` routes but vLLM's adapter routes (admin scope), of an app
  that Serve's route table (the proxy's own, longest prefix first) names and whose fresh entries
  are all keyed.  A path of another app, of an open app or of no app, and every request while
  the table is unread or the route table is not found, goes through untouched.
- A refusal is the app's own 401 (``auth.unauthorized``: our error body, ``WWW-Authenticate:
  Bearer``) with an ``X-Request-Id``, logged by the proxy (its Serve log file) as the app logs a
  request, with ``by=proxy``, and counted in ``ray_attn_proxy_auth_refused_total``.
- No request waits for the table: it is read on a thread, at most every ``REFRESH_EVERY_S``
  (with the GCS away, a read blocks until it is back, and requests go on meanwhile).  A key
  that the table does not hold is refused only by a table read within ``TRUSTED_FOR_S``; with
  an older one (the GCS away, or no read yet) the request goes on to the app's check.  A key
  added to the app's key file is refused by the proxy until the app has re-read the file (at
  most a second), published it (every ``PUBLISH_EVERY_S``) and the proxy has read it (every
  ``REFRESH_EVERY_S`` while requests come): about three seconds at most.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, Optional

from ray_attn.serve.auth import ADMIN_PATHS, Auth, bearer, unauthorized

log = logging.getLogger("ray.serve")

NAMESPACE = "ray_attn"
PREFIX = "ray_attn/proxy_auth/"
PUBLISH_EVERY_S = 1.0
STALE_AFTER_S = 10.0  # an entry not renewed for this long is an ingress gone
REFRESH_EVERY_S = 1.0
TRUSTED_FOR_S = 3.0  # a table read this recently judges; an older one (the GCS away) does not
CALLBACK = "ray_attn.serve.proxy_auth:proxy_middlewares"
CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"


def digest(key: bytes) -> str:
    return hashlib.sha256(key).hexdigest()


def entry_of(auth: Optional[Auth]) -> dict:
    """What an ingress publishes: its API keys' digests (the scope of the routes the proxy
    guards), or none for an open app."""
    if auth is None or not auth.api.configured:
        return {"open": True, "stamp": time.time()}
    return {"open": False, "digests": sorted({digest(k) for k in auth.api.keys()}), "stamp": time.time()}


class Publisher:
    """Renews one ingress's entry every ``every_s`` on a daemon thread, so a key file's re-read
    reaches the proxies; ``close()`` deletes the entry.  Outside Ray (a test's app), a no-op."""

    def __init__(self, name: str, auth_of: Callable[[], Optional[Auth]], every_s: float = PUBLISH_EVERY_S,
                 kv=None):
        self.key, self.auth_of, self.every_s = (PREFIX + name).encode(), auth_of, every_s
        self.kv = kv if kv is not None else _internal_kv()
        self._stop = threading.Event()
        self._thread = None
        if self.kv is None:
            return
        self.publish()
        self._thread = threading.Thread(target=self._run, name="ray_attn-proxy-auth-publish", daemon=True)
        self._thread.start()

    def publish(self) -> None:
        try:
            self.kv.put(self.key, json.dumps(entry_of(self.auth_of())).encode())
        except Exception:  # the GCS away for a moment: the next renewal tries again
            log.warning("proxy_auth: could not publish the keys' digests", exc_info=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.publish()

    def close(self) -> None:
        self._stop.set()
        if self.kv is not None:
            try:
                self.kv.delete(self.key)
            except Exception:
                pass


def publish_from_replica(auth_of: Callable[[], Optional[Auth]]) -> Optional[Publisher]:
    """A :class:`Publisher` named for this Serve replica (its app and id); None outside Serve."""
    try:
        from ray import serve

        ctx = serve.get_replica_context()
    except Exception:  # not in a replica (a test's app, a script)
        return None
    return Publisher(f"{ctx.app_name}/{ctx.replica_id.unique_id}", auth_of)


class KV:
    """Ray's internal KV in our namespace (the GCS's table; every node's proxy sees it)."""

    def __init__(self, internal_kv):
        self._kv = internal_kv

    def put(self, key: bytes, value: bytes) -> None:
        self._kv._internal_kv_put(key, value, overwrite=True, namespace=NAMESPACE)

    def delete(self, key: bytes) -> None:
        self._kv._internal_kv_del(key, namespace=NAMESPACE)

    def entries(self) -> list[tuple[bytes, bytes]]:
        keys = self._kv._internal_kv_list(PREFIX, namespace=NAMESPACE) or []
        pairs = [(k, self._kv._internal_kv_get(k, namespace=NAMESPACE)) for k in keys]
        return [(k, v) for k, v in pairs if v]


def _internal_kv() -> Optional[KV]:
    try:
        import ray
        from ray.experimental import internal_kv
    except ImportError:
        return None
    return KV(internal_kv) if ray.is_initialized() and internal_kv._internal_kv_initialized() else None


OPEN = None  # an app's digests in the table when it takes requests without a key


class Table:
    """The proxy's view of the published entries: ``apps`` maps an app's name to its keys'
    digests, or to ``OPEN``.  Read on a thread of its own, never awaited by a request: with the
    GCS away (restarting) a read blocks, and the proxy must go on routing meanwhile."""

    def __init__(self, kv=None, clock: Callable[[], float] = time.time):
        self.kv, self.clock = kv, clock
        self.apps: dict[str, Optional[frozenset]] = {}
        self.read_at = float("-inf")
        self._reading = False
        self._lock = threading.Lock()
        self._pool: Optional[ThreadPoolExecutor] = None

    def age(self) -> float:
        return self.clock() - self.read_at

    def load(self, raw: Iterable[tuple[bytes, bytes]]) -> None:
        """From ``(kv key, value)`` pairs; stale and unreadable entries are skipped.  An app with
        any open entry (a redeploy that dropped its keys, seen half done) is open."""
        now, apps = self.clock(), {}
        for key, value in raw:
            try:
                app = key.decode()[len(PREFIX):].rsplit("/", 1)[0]
                e = json.loads(value)
                if now - float(e["stamp"]) > STALE_AFTER_S:
                    continue
                if e.get("open", True):
                    apps[app] = OPEN
                elif app not in apps or apps[app] is not OPEN:
                    apps[app] = (apps.get(app) or frozenset()) | frozenset(str(d) for d in e["digests"])
            except (ValueError, KeyError, TypeError, UnicodeDecodeError):
                continue  # not ours to judge: skip it
        self.apps, self.read_at = apps, now

    def refresh_soon(self, older_than_s: float) -> Optional[Future]:
        """Start a read if the table is older than ``older_than_s`` and none is under way."""
        if self.age() < older_than_s:
            return None
        with self._lock:
            if self._reading:
                return None
            kv = self.kv or _internal_kv()
            if kv is None:
                return None
            self.kv, self._reading = kv, True
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="ray_attn-proxy-auth")
        return self._pool.submit(self._read)

    def _read(self) -> None:
        try:
            self.load(self.kv.entries())
        except Exception:  # noqa: BLE001 -- the GCS away: the next request asks again
            log.warning("proxy_auth: could not read the published digests", exc_info=True)
        finally:
            self._reading = False


def _guarded(path: str) -> bool:
    """A ``/v1/...`` route (under any route prefix), not one of the admin-scope adapter routes."""
    i = path.find("/v1/")
    return i >= 0 and path[i:] not in ADMIN_PATHS


def _proxy_router(app):
    """Serve's route table, from the proxy's ASGI app under the middlewares wrapping it (None if
    Serve's internals moved: then nothing is refused)."""
    for _ in range(16):
        router = getattr(app, "proxy_router", None)
        if router is not None:
            return router
        app = getattr(app, "app", None) or getattr(app, "_app", None)  # Serve's own keep it as _app
        if app is None:
            return None
    return None


def app_of(router, path: str) -> Optional[str]:
    """The name of the app Serve routes ``path`` to: the longest matching route prefix, as
    Serve's ``ProxyRouter.match_route`` picks it."""
    for route in router.sorted_routes:
        if path.startswith(route) and (route.endswith("/") or len(path) == len(route) or path[len(route)] == "/"):
            return router.route_info[route].app_name
    return None


class ProxyAuthMiddleware:
    """Pure ASGI, outermost in the proxy: see the module docstring."""

    def __init__(self, app, table: Optional[Table] = None, router=None):
        self.app, self.table = app, table or Table()
        self.router = router
        self.refused = _counter()
        # The two refusals, built once: under a flood, building the app's JSONResponse for each
        # request (the error body's model and four json.dumps) was about half of a refusal's
        # cost in the proxy's one event loop (111 -> 53 us).  The bytes are the app's own
        # (``auth.unauthorized``).
        self._refusals = {missing: _refusal(unauthorized("API", None if missing else b"x"))
                          for missing in (True, False)}

    def _accepts(self, app_name: str, credential: Optional[bytes]) -> bool:
        digests = self.table.apps.get(app_name, OPEN)
        if digests is OPEN:
            return True
        if credential is None:
            return False
        d = digest(credential)
        ok = False
        for known in digests:  # every digest compared, as auth.KeyRing does with keys
            ok |= hmac.compare_digest(known, d)
        return ok

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not _guarded(path):
            return await self.app(scope, receive, send)
        if self.router is None:
            self.router = _proxy_router(self.app)
        app_name = app_of(self.router, path) if self.router is not None else None
        if app_name is None:  # no app there (Serve answers 404) or no route table: not ours
            return await self.app(scope, receive, send)
        self.table.refresh_soon(REFRESH_EVERY_S)
        credential = bearer(scope)
        if not self._accepts(app_name, credential):
            if self.table.age() < TRUSTED_FOR_S:
                return await self._refuse(scope, receive, send, credential)
            # no read for a while (the GCS away, or the proxy's first request): the app judges
        await self.app(scope, receive, send)

    async def _refuse(self, scope, receive, send, credential):
        from ray_attn.serve.request_log import REQUEST_ID_HEADER, RequestLog, log_line

        global _refused_here
        _refused_here += 1
        if self.refused is not None:
            self.refused.inc()
        rec, _ = RequestLog().start(scope)  # the request's id (the client's, or a new one) and client
        headers, body = self._refusals[credential is None]
        await send({"type": "http.response.start", "status": 401,
                    "headers": headers + [(REQUEST_ID_HEADER, rec.request_id.encode())]})
        await send({"type": "http.response.body", "body": body})
        rec.status, rec.ended_ns = 401, time.time_ns()
        log_line(rec, " by=proxy")


_refused_here = 0  # by this process's proxy: each proxy on a port counts its own share (api_servers.py)


def refused_here() -> int:
    return _refused_here


def _refusal(error) -> tuple[list, bytes]:
    """A refusal's ASGI response headers (without its request id) and body, as the app sends it."""
    response = error.response()
    return list(response.raw_headers), bytes(response.body)


def _counter():
    try:
        from ray.util.metrics import Counter

        return Counter("ray_attn_proxy_auth_refused_total",
                       description="Requests Serve's HTTP proxy refused for a missing or wrong API key.")
    except Exception:  # outside a Ray worker: no metric
        return None


def proxy_middlewares() -> list:
    """Serve's proxy callback (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``)."""
    from starlette.middleware import Middleware

    return [Middleware(ProxyAuthMiddleware)]
