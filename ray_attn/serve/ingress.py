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
import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

import numpy as np
from ray import serve
from ray.serve.exceptions import BackPressureError
from starlette.requests import Request
from starlette.responses import Response

from ray_attn.planner.block_pool import ROOT_HASH, prompt_hashes
from ray_attn.serve.auth import Auth
from ray_attn.serve.http import HTTPError
from ray_attn.serve.request_log import RequestLog, request_id_of, with_request_id
from ray_attn.serve.resume import EXTENSION, StreamProgress
from ray_attn.serve.schemas import ServeAppConfig

log = logging.getLogger("ray.serve")

TEXT_BYTES_PER_TOKEN = 4
REPLICA_HEADER = b"x-replica-id"
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


# ------------------------------------------------------------------------------- the front side
async def _send_error(send, status: int, field_name: str, detail: str, headers=()) -> None:
    body = json.dumps(HTTPError(status, [(field_name, detail)]).body()).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        *headers]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class RelayedResponse(Response):
    """Sends the ASGI messages a replica's ``handle_http`` yields, as they come.

    Serve sends a returned Response by calling it as an ASGI app, so this is where the replica's
    answer meets the client.  When the replica fails (it died, its node was lost) the request
    goes to another replica, up to ``max_attempts`` times in all:

    - before it started answering (every non-streaming request, a stream before its headers),
      it is sent again as it came: the client sees one answer;
    - mid-stream, with ``resume``, it goes on where it stopped (``serve/resume.py``): the new
      replica's headers are dropped and its events relayed, so the client sees each token once;
    - a retry that no replica takes within ``retry_timeout_s`` (every replica gone) is given up;
    - when no attempt is left, or the stream cannot be resumed, a stream ends with an error
      event and ``[DONE]`` (never a cut that looks finished), and an answer not begun is a 503
      with Retry-After.  Serve's own queue being full is a 503 at once: a retry would only
      add to the queue."""

    def __init__(self, call, routed: RoutedHTTPRequest, retry_after_s: int, max_attempts: int = 1,
                 retry_delay_s: float = 0.5, retry_timeout_s: float = 60.0, request_id: Optional[bytes] = None):
        self.call, self.routed = call, routed
        self.retry = [(b"retry-after", str(retry_after_s).encode())]
        # The id the front gave a request whose own X-Request-Id it could not use: Serve's proxy
        # echoes the client's, so the answer names the one the replicas used too.
        self.id_header = [(b"x-request-id", request_id)] if request_id else []
        self.max_attempts, self.retry_delay_s, self.retry_timeout_s = max_attempts, retry_delay_s, retry_timeout_s
        self.background = None
        self.attempts = 0

    async def __call__(self, scope, receive, send) -> None:
        started, stream, progress, routed = False, False, StreamProgress(), self.routed
        while True:
            self.attempts += 1
            try:
                # A client that goes away cancels this; Serve then cancels the handle call, and
                # run_asgi the replica's handler, which aborts the request and frees its blocks.
                async for message in self._messages(routed):
                    kind = message.get("type")
                    if kind == "http.response.start":
                        if started:
                            continue  # a resumed stream: the client has its headers already
                        started = True
                        if self.id_header:
                            message = dict(message, headers=[*message.get("headers", ()), *self.id_header])
                        stream = _is_event_stream(message)
                    elif kind == "http.response.body" and stream and routed.resumable:
                        message = dict(message, body=progress.feed(message.get("body", b"")))
                    await send(message)
                return
            except _NoReplica as e:
                if started:
                    return await self._end_stream(send, "replica", f"replica: {e}; retry the request")
                return await _send_error(send, 503, "replica", f"replica: {e}; retry later",
                                         self.retry + self.id_header)
            except BackPressureError as e:
                if started:
                    return await self._end_stream(send, "queue", f"queue: every replica is at capacity ({e})")
                return await _send_error(send, 503, "queue", f"queue: every replica is at capacity ({e}); "
                                                             f"retry later", self.retry + self.id_header)
            except Exception as e:  # noqa: BLE001 - a replica died under the request
                what = f"{type(e).__name__}"
                resumable = not started or (stream and routed.resumable and progress.state.head)
                log.warning("replica lost under a request (attempt %d of %d, %s): %s: %s", self.attempts,
                            self.max_attempts, "resuming" if started else "retrying", what, e)
                if self.attempts >= self.max_attempts or not resumable:
                    if not started:
                        return await _send_error(send, 503, "replica", f"replica: request failed ({what}); "
                                                                       f"retry later", self.retry + self.id_header)
                    if not stream:
                        raise
                    return await self._end_stream(send, "replica", f"replica: lost mid-stream ({what}) and "
                                                                   f"not resumed; retry the request")
                if started:
                    routed = dataclasses.replace(routed, resume=progress.state.to_json())
                await asyncio.sleep(self.retry_delay_s)  # Serve's router learns of the loss meanwhile

    async def _messages(self, routed: RoutedHTTPRequest):
        """The replica's messages; a retry that gets none within ``retry_timeout_s`` (every
        replica gone: Serve's router would hold it until one comes back) is ``_NoReplica``."""
        response = self.call(routed)
        it = response.__aiter__()
        wait = self.retry_timeout_s if self.attempts > 1 else None
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

    async def _end_stream(self, send, field_name: str, detail: str) -> None:
        """An in-stream error event (vLLM's, as ``openai/serving.sse_error``), then the end."""
        err = json.dumps(HTTPError(503, [(field_name, detail)]).body())
        await send({"type": "http.response.body", "body": f"data: {err}\n\ndata: [DONE]\n\n".encode(),
                    "more_body": False})


class _NoReplica(Exception):
    pass


def _is_event_stream(start: dict) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
               for k, v in start.get("headers", ()))


# A plain deployment (no @serve.ingress): Serve allows one FastAPI/ASGI deployment per app, and
# that is the LLMServer.  Serve hands __call__ a starlette Request for every path.
@serve.deployment(name="PrefixRoutingIngress")
class PrefixRoutingIngress:
    def __init__(self, llm_server, block_size: int, max_body_bytes: int, retry_after_s: int,
                 resume_requests: bool = False, max_attempts: int = 1, retry_timeout_s: float = 60.0,
                 app_config: Optional[dict] = None):
        cfg = ServeAppConfig.model_validate(app_config or {})
        self.auth = Auth.from_config(cfg)  # the replicas' keys, read in this process
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
        return RelayedResponse(self.llm.remote, routed, self.retry_after_s, self.max_attempts,
                               retry_timeout_s=self.retry_timeout_s,
                               request_id=None if given == rid.encode() else rid.encode())


    def _answered(self, request: Request, error: HTTPError) -> Response:
        """An answer of the front's own, with its log line (the replicas log the rest)."""
        rec, header = self.requests.start(request.scope)
        rec.status = error.status
        self.requests.finish(rec)
        response = error.response()
        if header is not None:
            response.headers["x-request-id"] = header.decode()
        return response


def build_routed_app(cfg: ServeAppConfig, llm_server):
    """The prefix-aware app: the front deployment bound to ``llm_server``, the replicas' deployment
    with its options set (``app.build_app`` passes it in: the replica imports this module for
    ``run_asgi``, so this one cannot import the replica)."""
    llm = llm_server.bind(cfg.model_dump(mode="json"))
    front = cfg.prefix_router
    return PrefixRoutingIngress.options(
        ray_actor_options={"num_cpus": front.ingress_num_cpus,
                           **({"resources": dict(front.ingress_resources)} if front.ingress_resources else {})},
        max_ongoing_requests=front.ingress_max_ongoing_requests,
    ).bind(llm, block_size=cfg.engine.cache.block_size, max_body_bytes=cfg.max_body_bytes,
           retry_after_s=cfg.retry_after_s, resume_requests=cfg.resume_requests,
           max_attempts=cfg.max_request_attempts, retry_timeout_s=cfg.retry_timeout_s,
           app_config=cfg.model_dump(mode="json"))


__all__ = ["REPLICA_HEADER", "PrefixRoutingIngress", "RoutedHTTPRequest", "build_routed_app",
           "forwarded_scope", "prefix_block_hashes", "prompt_units", "run_asgi"]
