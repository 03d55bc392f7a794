"""More HTTP proxies on each node's Serve port (vLLM's ``--api-server-count``).

Why: Serve runs one HTTP proxy per node, and a proxy is one Python event loop.  It accepts,
parses and routes every connection of its node, and answers refusals itself (proxy_auth.py).  A
flood of connections queues in that one loop, and a keyed request sent meanwhile waits its turn
(issue 42: ``scripts/hostile_burst.py``).  More loops on the same port share the flood.

How:
- Serve binds its proxy's socket with SO_REUSEPORT (``SERVE_SOCKET_REUSE_PORT_ENABLED``, on by
  default).  So another process may listen on the same address and port, and the kernel spreads
  new connections over the listeners.  ``api_server_count: N`` in the app's args runs N - 1 more
  proxies (``ApiServer``: Serve's own ``ProxyActor`` with a lease) on every node that runs a
  Serve proxy.  They get the route table from the controller as Serve's proxy does.
- They live in Serve's namespace under names of their own (``RAY_ATTN_API_SERVER-<node>-<i>``):
  a proxy looks itself up by its actor name when a replica pulls a request's body from it.
- The app's ingress replicas keep them (``ApiServerKeeper``, a daemon thread).  Every
  ``KEEP_EVERY_S`` a keeper asks the controller which nodes run a proxy, gets or creates the
  extras there by name (replicas racing get the same actor), and renews their lease.
- An extra leaves when no keeper renewed it for ``LEASE_S`` (the app deleted, or fewer servers
  asked for), or when Serve's proxy on its node is gone (``serve.shutdown``, the node's proxy
  drained).  It stops listening, lets the requests it holds finish (up to ``DRAIN_S``) and exits.
  Extras are detached: a replica's restart does not take the node's extras with it.
- The extras refuse unkeyed requests as Serve's proxy does: they get the proxy callback
  (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``) of the keeper's process, or proxy_auth's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import Optional

log = logging.getLogger("ray.serve")

PREFIX = "RAY_ATTN_API_SERVER"
KEEP_EVERY_S = 2.0
LEASE_S = 10.0  # five missed renewals: the keepers are gone
WATCH_EVERY_S = 1.0
DRAIN_S = 30.0  # what a leaving extra gives the requests it holds


def api_server_name(node_id: str, i: int) -> str:
    return f"{PREFIX}-{node_id}-{i}"


def _serve_proxy_name(node_id: str) -> str:
    from ray.serve._private.constants import SERVE_PROXY_NAME
    from ray.serve._private.utils import format_actor_name

    return format_actor_name(SERVE_PROXY_NAME, node_id)


def _named_actor_alive(name: str) -> bool:
    import ray
    from ray.serve._private.constants import SERVE_NAMESPACE

    try:
        ray.get_actor(name, namespace=SERVE_NAMESPACE)
        return True
    except ValueError:  # no live actor of that name
        return False


def serve_proxy_nodes(controller=None) -> set[str]:
    """The nodes Serve runs an HTTP proxy on, as its controller lists them: the nodes a keeper
    gives extras to."""
    import ray

    controller = controller or _serve_controller()
    return set(ray.get(controller.get_proxies.remote(), timeout=30))


def _serve_controller():
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    return ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)


_API_SERVER = None


def api_server_class():
    """``ApiServer``, made once: Serve's ``ProxyActor`` (its undecorated class) with a lease and
    a way out.  Built on first use, so importing this module imports none of Serve's internals."""
    global _API_SERVER
    if _API_SERVER is not None:
        return _API_SERVER
    import ray
    from ray._common.utils import get_or_create_event_loop
    from ray.serve._private.proxy import ProxyActor
    from ray.serve.config import gRPCOptions

    base = ProxyActor.__ray_metadata__.modified_class.__ray_actor_class__

    class ApiServer(base):
        """One more HTTP proxy on this node's Serve port (the module docstring)."""

        def __init__(self, http_options, *, node_id: str, node_ip_address: str, logging_config,
                     lease_s: float = LEASE_S, serve_proxy_name: Optional[str] = None,
                     watch_every_s: float = WATCH_EVERY_S, drain_s: float = DRAIN_S):
            # gRPC stays Serve's own proxy's: an extra serves HTTP only.
            super().__init__(http_options, gRPCOptions(), node_id=node_id, node_ip_address=node_ip_address,
                             logging_config=logging_config)
            self._lease_s, self._lease_until = lease_s, time.monotonic() + lease_s
            self._serve_proxy = serve_proxy_name or _serve_proxy_name(node_id)
            self._watch_every_s, self._drain_s = watch_every_s, drain_s
            self._leaving: Optional[str] = None
            # the actor's loop, which ProxyActor's own tasks run on
            self._watchdog = get_or_create_event_loop().create_task(self._watch())

        def renew(self, lease_s: float = LEASE_S) -> bool:
            """A keeper's renewal; False once the extra is leaving (the keeper makes a new one)."""
            if self._leaving is None:
                self._lease_until = max(self._lease_until, time.monotonic() + lease_s)
            return self._leaving is None

        def leaving(self) -> Optional[str]:
            return self._leaving

        async def _watch(self) -> None:
            try:
                while self._leaving is None:
                    await asyncio.sleep(self._watch_every_s)
                    self._leaving = await self._reason_to_leave()
                log.info("ray_attn API server %s leaves: %s", ray.get_runtime_context().get_actor_name(),
                         self._leaving)
                await self._drain()
            except Exception:  # noqa: BLE001 -- whatever went wrong, an extra must not linger
                log.exception("ray_attn API server: its watchdog failed; it leaves")
            # As Serve's controller ends its proxies: ray.kill (exit_actor from this task left the
            # actor hung, its loop still holding the proxy's long-poll and router tasks).
            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

        async def _reason_to_leave(self) -> Optional[str]:
            start = self._start_http_server_task
            if start.done() and start.exception() is not None:
                return f"it could not listen: {start.exception()}"
            if time.monotonic() > self._lease_until:
                return f"no ray_attn app renewed it for {self._lease_s:g} s"
            if not await asyncio.to_thread(_named_actor_alive, self._serve_proxy):
                return "Serve's proxy on this node is gone"
            return None

        async def _drain(self) -> None:
            """Stop listening, let the connections it holds finish (``drain_s`` at most)."""
            start = self._start_http_server_task
            if not start.done() or start.exception() is not None:
                return
            serving, server = start.result()
            server.config.timeout_graceful_shutdown = self._drain_s
            server.should_exit = True
            try:
                await asyncio.wait_for(asyncio.shield(serving), self._drain_s + 5)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 -- leaving regardless
                pass

    _API_SERVER = ray.remote(ApiServer)
    return _API_SERVER


class ApiServerKeeper:
    """Keeps ``count - 1`` extra proxies on every node with a Serve proxy, from an ingress replica
    (the module docstring).  ``close()`` stops renewing: the extras leave ``LEASE_S`` later
    unless another replica of an app that wants them renews them."""

    def __init__(self, count: int, every_s: float = KEEP_EVERY_S, lease_s: float = LEASE_S):
        self.count, self.every_s, self.lease_s = count, every_s, lease_s
        self._http = None
        self._failed: set[str] = set()  # extras whose start was reported, not re-reported
        self._pending: dict = {}  # name -> the ready() ref of an extra this keeper made
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ray_attn-api-servers", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                self.keep()
            except Exception:  # noqa: BLE001 -- the controller or GCS away: the next round again
                log.warning("api_server_count: could not keep the extra API servers", exc_info=True)
            if self._stop.wait(self.every_s):
                return

    def keep(self) -> None:
        """One round: get or create every extra, renew its lease."""
        import ray

        controller = _serve_controller()
        nodes = serve_proxy_nodes(controller)
        if self._http is None:
            self._http = ray.get(controller.get_http_config.remote(), timeout=30)
        self._report_failed_starts()
        for node_id in sorted(nodes):
            for i in range(1, self.count):
                extra = self._get_or_create(api_server_name(node_id, i), node_id)
                if extra is not None:
                    extra.renew.remote(self.lease_s)

    def _get_or_create(self, name: str, node_id: str):
        """The extra by name; made if missing while Serve's proxy on its node lives, else None.
        The controller may still list a proxy that is gone (its node lost, ``serve.shutdown``
        under way): an extra made then would only find no proxy beside it and leave."""
        import ray
        from ray.serve._private.constants import SERVE_NAMESPACE
        from ray.serve.schema import LoggingConfig

        from ray_attn.serve.proxy_auth import CALLBACK, CALLBACK_ENV

        try:
            return ray.get_actor(name, namespace=SERVE_NAMESPACE)
        except ValueError:
            pass
        if not _named_actor_alive(_serve_proxy_name(node_id)):
            return None
        callback = os.environ.get(CALLBACK_ENV) or CALLBACK
        handle = api_server_class().options(
            name=name, namespace=SERVE_NAMESPACE, get_if_exists=True, lifetime="detached", num_cpus=0,
            max_concurrency=100_000, max_restarts=0,  # Serve's proxy's: a proxy's calls are all async
            scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node_id, soft=False),
            runtime_env={"env_vars": {CALLBACK_ENV: callback}},
        ).remote(self._http, node_id=node_id, node_ip_address=_node_ip(node_id), logging_config=LoggingConfig(),
                 lease_s=self.lease_s)
        self._pending[name] = handle.ready.remote()
        log.info("api_server_count: started %s", name)
        return handle

    def _report_failed_starts(self) -> None:
        import ray

        for name, ref in list(self._pending.items()):
            done, _ = ray.wait([ref], timeout=0)
            if not done:
                continue
            del self._pending[name]
            try:
                ray.get(ref)
            except Exception as e:  # noqa: BLE001 -- reported once; the extra leaves by itself
                if name not in self._failed:
                    self._failed.add(name)
                    log.error("api_server_count: %s could not start: %s", name, e)

    def close(self) -> None:
        self._stop.set()


def _node_ip(node_id: str) -> str:
    import ray

    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            return node.get("NodeManagerAddress", "127.0.0.1")
    return "127.0.0.1"


def keep_from_replica(count: int) -> Optional[ApiServerKeeper]:
    """An ``ApiServerKeeper`` in a Serve replica when more than one API server is asked for;
    None otherwise (one: Serve's proxy alone; outside Serve: a test's app, a script)."""
    if count <= 1:
        return None
    try:
        from ray import serve

        serve.get_replica_context()
    except Exception:  # not in a replica
        return None
    from ray.serve._private import proxy

    if not proxy.SOCKET_REUSE_PORT_ENABLED:
        log.warning("api_server_count=%d: SERVE_SOCKET_REUSE_PORT_ENABLED is off, so no second "
                    "proxy can listen on Serve's port; Serve's proxy serves alone", count)
        return None
    try:  # Serve's proxy class, as this module extends it (a private API: another Ray may move it)
        api_server_class()
        if not hasattr(proxy.ProxyActor.__ray_metadata__.modified_class, "ready"):
            raise AttributeError("ProxyActor.ready")
    except Exception as e:  # noqa: BLE001 -- said once; the app runs on Serve's proxy alone
        log.warning("api_server_count=%d: this Ray's Serve proxy cannot be extended (%s: %s); Serve's "
                    "proxy serves alone", count, type(e).__name__, e)
        return None
    return ApiServerKeeper(count)
