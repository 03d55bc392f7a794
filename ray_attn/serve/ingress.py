"""The prefix-aware app: a front deployment that reads each request's prompt, then the replicas.

``request_router: prefix_aware`` builds::

    HTTP proxy -> PrefixRoutingIngress (1 replica) --handle--> LLMServer replicas (PrefixAwareRequestRouter)

A request router only sees the arguments of a handle call, and behind the HTTP proxy those hold no
body (``ray_attn/serve/router.py`` says why).  So the front deployment reads the body (bounded by
``max_body_bytes``), hashes the prompt's leading blocks, and forwards the whole HTTP request --
scope, body and hashes in a ``RoutedHTTPRequest`` -- to an LLMServer replica's ``handle_http``.
That method runs the replica's own FastAPI app on it and streams the ASGI messages back, which the
front relays unchanged: every route, status, header and server-sent event is what a direct
request would get, and only the routing differs.

Prompts are read from ``prompt_token_ids``, a ``prompt`` given as token ids, a text ``prompt`` or
chat ``messages``.  Text is hashed by UTF-8 chunks of ``4 * block_size`` bytes (no tokenizer
here): equal text prefixes still meet on one replica.  A body with no prompt (``/stats``,
``/health``, malformed JSON) routes by load alone.

The front checks the API key itself, before it reads a byte of the body (``auth.py``, from the
same app config as the replicas): it reads whole bodies, so an unauthenticated flood must stop
here, not at the replica.  The replica checks the forwarded ``Authorization`` header again.  The
front also fixes the request's id in the forwarded headers (``request_log.py``), so that every
replica a resumed request runs on names it the same, and -- with tracing on -- gives a request
without a ``traceparent`` one, so that their spans join one trace.
"""

import asyncio
import hashlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

import numpy as np
from ray import serve
from starlette.requests import Request
from starlette.responses import Response

from ray_attn.planner.block_pool import ROOT_HASH, prompt_hashes
from ray_attn.serve.auth import Auth
from ray_attn.serve.api_servers import keep_from_replica
from ray_attn.serve.proxy_auth import publish_from_replica
from ray_attn.serve.http import HTTPError
from ray_attn.serve.request_log import RequestLog, request_id_of, with_request_id
from ray_attn.serve.progress_store import Unanswered, request_digest
from ray_attn.serve.relay import REPLICA_HEADER, RelayedResponse, StreamJournal, new_epoch
from ray_attn.serve.resume import EXTENSION
from ray_attn.serve.schemas import ServeAppConfig

log = logging.getLogger("ray.serve")

TEXT_BYTES_PER_TOKEN = 4
_TEXT_SALT = 0x7E47_0000_0000_0001  # keeps text-chunk hashes apart from token-block hashes
_SCOPE_KEYS = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path", "root_path",
               "query_string", "headers", "client", "server")


# ------------------------------------------------------------------------------------ the request
@dataclass(frozen=True)
class RoutedHTTPRequest:
    """An HTTP request forwarded over a handle; the router reads ``prefix_block_hashes``.
    ``resumable`` asks the replica for progress lines, ``resume`` (the JSON of a
    ``resume.Resume``) has it go on from a lost replica's stream (``serve/resume.py``)."""

    scope: dict
    body: bytes
    prefix_block_hashes: tuple = field(default=())
    resumable: bool = False
    resume: Optional[dict] = None

    def scope_for_app(self) -> dict:
        """The scope the replica's app runs on, with the front's asks in its extensions (where
        an HTTP client cannot put them)."""
        if not self.resumable and self.resume is None:
            return self.scope
        ext = dict(self.scope.get("extensions") or {})
        ext[EXTENSION] = {"resumable": self.resumable, "resume": self.resume}
        return dict(self.scope, extensions=ext)


def prompt_units(body: bytes) -> tuple[Optional[np.ndarray], int]:
    """The prompt of a JSON body as (units, units per token): token ids, or UTF-8 bytes of text."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None, 1
    if not isinstance(data, dict):
        return None, 1
    for key in ("prompt_token_ids", "prompt"):
        ids = data.get(key)
        if isinstance(ids, list) and ids and all(type(t) is int and t >= 0 for t in ids):
            return np.asarray(ids, dtype=np.int64), 1
    text = data.get("prompt")
    if not isinstance(text, str):
        text = _messages_text(data.get("messages"))
    if text:
        return np.frombuffer(text.encode("utf-8", "replace"), dtype=np.uint8), TEXT_BYTES_PER_TOKEN
    return None, 1


def _messages_text(messages: Any) -> Optional[str]:
    if not isinstance(messages, list):
        return None
    parts = []
    for m in messages:
        if not isinstance(m, dict):
            return None
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict)
                              and isinstance(p.get("text"), str))
        if not isinstance(content, str):
            return None
        parts.append(f"{m.get('role', '')}\n{content}\n")
    return "".join(parts)


def adapter_of(body: bytes, served_model: Optional[str]) -> Optional[str]:
    """The LoRA adapter a body's ``model`` names (``"<adapter>"`` or ``"<served>:<adapter>"``),
    None for the served model itself (or when the front does not know its name)."""
    try:
        model = json.loads(body).get("model")
    except (ValueError, AttributeError):
        return None
    if served_model is None or not isinstance(model, str) or model == served_model:
        return None
    base, sep, name = model.partition(":")
    return (name if base == served_model else None) if sep else model


def adapter_root(name: str) -> int:
    """The front's chain root for an adapter's prompts (the planner roots its own chains per
    adapter too, ``LoRARequest.cache_root``): equal prompts of two adapters never match."""
    return int.from_bytes(hashlib.blake2b(f"lora\0{name}".encode(), digest_size=8).digest(), "little")


def prefix_block_hashes(body: bytes, block_size: int, served_model: Optional[str] = None) -> tuple[int, ...]:
    """Chain hashes of the prompt's full blocks (the planner's ``prompt_hashes``); () when none.
    Under a LoRA adapter the chains start at its root, and the root itself leads them: a replica
    that served the adapter (and so holds it) matches one block more, whatever the prompt."""
    units, per_token = prompt_units(body)
    adapter = adapter_of(body, served_model)
    root = ROOT_HASH if adapter is None else adapter_root(adapter)
    lead = () if adapter is None else (root,)
    if units is None:
        return lead
    size = block_size * per_token
    n = len(units) // size
    hashes = prompt_hashes(units, n, size, root)
    if per_token != 1:
        hashes = hashes ^ np.uint64(_TEXT_SALT)
    return lead + tuple(int(h) for h in hashes)


def forwarded_scope(scope: dict) -> dict:
    """The picklable part of an HTTP scope that the replica's app needs to route and answer."""
    out = {k: scope[k] for k in _SCOPE_KEYS if k in scope}
    out["headers"] = [(bytes(k), bytes(v)) for k, v in scope.get("headers", [])]
    return out


# -------------------------------------------------------------------------- the replica's side
async def run_asgi(app, scope: dict, body: bytes) -> AsyncIterator[dict]:
    """Run ASGI ``app`` on one buffered request and yield the messages it sends, as it sends them.

    When the consumer stops early (the client went away and Serve cancelled the call), the app's
    task is cancelled, so its handler aborts the request and frees its blocks."""
    queue: asyncio.Queue = asyncio.Queue()
    end = object()
    delivered = False

    async def receive():
        nonlocal delivered
        if delivered:
            # Starlette polls for a disconnect while it streams: none comes from a buffered body,
            # so wait until the response is done and this task is cancelled.
            await asyncio.Event().wait()
        delivered = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict) -> None:
        await queue.put(message)

    async def run():
        try:
            await app(scope, receive, send)
        finally:
            queue.put_nowait(end)

    task = asyncio.ensure_future(run())
    completed = False
    try:
        while (message := await queue.get()) is not end:
            completed = message.get("type") == "http.response.body" and not message.get("more_body")
            yield message
        if task.exception() is not None and not completed:
            raise task.exception()
    finally:
        if not task.done():
            task.cancel()


# A plain deployment (no @serve.ingress): Serve allows one FastAPI/ASGI deployment per app, and
# that is the LLMServer.  Serve hands __call__ a starlette Request for every path.
@serve.deployment(name="PrefixRoutingIngress")
class PrefixRoutingIngress:
    def __init__(self, llm_server, block_size: int, max_body_bytes: int, retry_after_s: int,
                 resume_requests: bool = False, max_attempts: int = 1, retry_timeout_s: float = 60.0,
                 app_config: Optional[dict] = None):
        cfg = ServeAppConfig.model_validate(app_config or {})
        self.auth = Auth.from_config(cfg)  # the replicas' keys, read in this process
        self.proxy_auth = publish_from_replica(lambda: self.auth)  # for Serve's proxy (proxy_auth.py)
        self.api_servers = keep_from_replica(cfg.api_server_count)  # more proxies (api_servers.py)
        # the lines of the requests it answers itself; Serve's proxy sends their X-Request-ID
        self.requests = RequestLog.from_config(cfg, proxy_echoes_id=True)
        self.traced = cfg.otlp_traces_endpoint is not None
        self.llm = llm_server.options(stream=True, method_name="handle_http")
        self.block_size = block_size
        self.served_model = cfg.model_id() if cfg.lora_modules or cfg.dynamic_lora_loading_path else None
        self.max_body_bytes = max_body_bytes
        self.retry_after_s = retry_after_s
        self.resume_requests = resume_requests
        self.max_attempts = max_attempts if resume_requests else 1
        self.retry_timeout_s = retry_timeout_s
        # Streams' logs, for a client that reconnects to another front replica (relay.py):
        # only inside Serve (a test builds one directly, and may set ``stores`` itself).
        self.stores, self.front_id = None, None
        if resume_requests:
            self.stores, self.front_id = _stores_here(cfg.resume_window_s)

    def __del__(self):
        # Serve calls this when it stops the replica: its entry leaves the proxies' table now,
        # not when its stamp goes stale (proxy_auth.py), as LLMServer's does.
        if getattr(self, "proxy_auth", None) is not None:
            self.proxy_auth.close()
        if getattr(self, "api_servers", None) is not None:  # the extras leave once no replica renews them
            self.api_servers.close()

    async def __call__(self, request: Request) -> Response:
        refusal = self.auth.check(request.scope)
        if refusal is not None:  # before the body: a flood without a key costs no reads
            return self._answered(request, refusal)
        limit = self.max_body_bytes
        cl = request.headers.get("content-length", "")
        chunks, size = [], int(cl) if cl.isdigit() else 0
        if size <= limit:
            size = 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    break
                chunks.append(chunk)
        if size > limit:
            return self._answered(request, HTTPError(413, [("body", f"body: larger than the limit of {limit} "
                                                                    f"bytes (max_body_bytes)")]))
        body = b"".join(chunks)
        scope = forwarded_scope(request.scope)
        rid, given = request_id_of(scope)
        scope = with_request_id(scope, rid)  # one id for every attempt
        if self.traced and not any(k == b"traceparent" for k, _ in scope["headers"]):
            from ray_attn.serve.tracing import new_traceparent

            scope["headers"].append((b"traceparent", new_traceparent().encode()))
        routed = RoutedHTTPRequest(scope, body,
                                   prefix_block_hashes(body, self.block_size, self.served_model),
                                   resumable=self.resume_requests)
        kw = dict(retry_timeout_s=self.retry_timeout_s, front_id=self.front_id,
                  request_id=None if given == rid.encode() else rid.encode())
        if not self.resume_requests or self.stores is None:
            return RelayedResponse(self.llm.remote, routed, self.retry_after_s, self.max_attempts, **kw)
        digest = request_digest(scope.get("method", ""), scope.get("path", ""), body,
                                request.headers.get("authorization", "").encode())
        last = request.headers.get("last-event-id")
        if last is None:  # a new request (whatever its id): its stream, if it is one, is logged
            journal = StreamJournal(self.stores, rid, digest, new_epoch())
            return RelayedResponse(self.llm.remote, routed, self.retry_after_s, self.max_attempts,
                                   journal=journal, **kw)
        try:
            last_id = int(last)
        except ValueError:
            last_id = -2
        if last_id < -1:
            return self._answered(request, HTTPError(400, [("last-event-id", f"last-event-id: {last[:40]!r} is "
                                                                             f"not an event id of this server")]))
        epoch = new_epoch()
        try:
            rec = await self.stores.takeover(rid, epoch)
        except Unanswered as e:
            error = HTTPError(503, [("last-event-id", f"last-event-id: stream {rid!r} not found yet ({e}); "
                                                      f"retry later")])
            response = self._answered(request, error)
            response.headers["retry-after"] = str(self.retry_after_s)
            return response
        if rec is None:
            return self._answered(request, HTTPError(410, [("last-event-id", (
                f"last-event-id: no stream {rid!r} to resume (ended more than resume_window_s ago, "
                f"never begun, or its progress was lost); send the request again without Last-Event-ID"))]))
        if rec.digest != digest:
            return self._answered(request, HTTPError(409, [("body", f"body: not the request stream {rid!r} was "
                                                                    f"begun with (method, path, body and key "
                                                                    f"must be the same)")]))
        if last_id >= len(rec.events):
            return self._answered(request, HTTPError(409, [("last-event-id", (
                f"last-event-id: {last_id} is beyond the {len(rec.events)} events stream {rid!r} has sent"))]))
        journal = StreamJournal(self.stores, rid, digest, new_epoch(max(epoch, rec.epoch)), record=rec)
        log.info("stream %s reconnected after event %d of %d", rid, last_id, len(rec.events))
        return RelayedResponse(self.llm.remote, routed, self.retry_after_s, self.max_attempts, journal=journal,
                               reconnect=rec, last_event_id=last_id, **kw)


    def _answered(self, request: Request, error: HTTPError) -> Response:
        """An answer of the front's own, with its log line (the replicas log the rest)."""
        rec, header = self.requests.start(request.scope)
        rec.status = error.status
        self.requests.finish(rec)
        response = error.response()
        if header is not None:
            response.headers["x-request-id"] = header.decode()
        return response


def _stores_here(window_s: float):
    """This front replica's ProgressStores and id, or (None, None) outside a Serve replica."""
    try:
        ctx = serve.get_replica_context()
    except Exception:  # noqa: BLE001 - built directly (tests)
        return None, None
    import ray

    from ray_attn.serve.progress_store import ProgressStores

    stores = ProgressStores(ctx.app_name, ray.get_runtime_context().get_node_id(), window_s)
    stores.start()
    return stores, ctx.replica_id.unique_id.encode()


def build_routed_app(cfg: ServeAppConfig, llm_server):
    """The prefix-aware app: the front deployment bound to ``llm_server``, the replicas' deployment
    with its options set (``app.build_app`` passes it in: the replica imports this module for
    ``run_asgi``, so this one cannot import the replica)."""
    llm = llm_server.bind(cfg.model_dump(mode="json"))
    front = cfg.prefix_router
    spread = {"max_replicas_per_node": front.ingress_max_replicas_per_node} \
        if front.ingress_max_replicas_per_node else {}
    return PrefixRoutingIngress.options(
        # Serve spreads a deployment's replicas over nodes by default (soft); the cap makes it hard
        num_replicas=front.ingress_num_replicas, **spread,
        ray_actor_options={"num_cpus": front.ingress_num_cpus,
                           **({"resources": dict(front.ingress_resources)} if front.ingress_resources else {})},
        max_ongoing_requests=front.ingress_max_ongoing_requests,
    ).bind(llm, block_size=cfg.engine.cache.block_size, max_body_bytes=cfg.max_body_bytes,
           retry_after_s=cfg.retry_after_s, resume_requests=cfg.resume_requests,
           max_attempts=cfg.max_request_attempts, retry_timeout_s=cfg.retry_timeout_s,
           app_config=cfg.model_dump(mode="json"))


__all__ = ["REPLICA_HEADER", "PrefixRoutingIngress", "RelayedResponse", "RoutedHTTPRequest", "build_routed_app",
           "forwarded_scope", "prefix_block_hashes", "prompt_units", "run_asgi"]
