"""The Ray Serve app: one replica = one engine (driven by one thread) + its TP worker actors.

``build_app(args)`` is the ``import_path`` target of ``deploy/serve_config.yaml``.  It validates the
args as a :class:`ServeAppConfig` and sets the deployment's placement group to
``[{"CPU": replica_num_cpus}] + [rank bundle] * tp`` with ``STRICT_PACK``: Serve reserves the
replica and its ranks' CPUs/GPUs together, and the replica starts its workers in bundles 1..tp of
that group, so a replica and its GPUs come and go together.

HTTP API (FastAPI ingress):
  POST /v1/completions        OpenAI completions (``ray_attn/serve/openai/completions.py``)
  POST /v1/chat/completions   OpenAI chat, through the tokenizer's chat template (``openai/chat.py``)
  GET  /v1/models             the served model's name, context length and vocabulary, and its adapters
  POST /v1/load_lora_adapter, /v1/unload_lora_adapter (and /admin/v1/...)  LoRA adapters (admin key)
  POST /tokenize, /detokenize vLLM's: a prompt or messages to the ids the engine would get, and back
  GET  /metrics       this replica's metrics as Prometheus text (``ray_attn/serve/prometheus.py``)
  POST /v1/generate   JSON body (GenerateRequest); ``"stream": true`` answers with server-sent events
  GET  /health        200 when the engine loop runs and every worker answers its ping, else 503
                      (the latest ping's answer: a poll never waits on one, ``serve/health.py``)
  GET  /stats         KV blocks, prefix-cache hit rate, cascade rate, steps/s, tokens/s, queue depth
  POST /admin/reload_api_keys  re-read the key files now (admin key; off unless one is configured)

With API keys configured every route but /health needs ``Authorization: Bearer <key>``
(``ray_attn/serve/auth.py``), checked before anything else -- admission counts, body reads --
happens; every request gets an id (``X-Request-Id``) and a log line (``request_log.py``), and
spans when tracing is on (``tracing.py``).

Request bodies are read with a byte cap and a deadline and parsed as JSON by pydantic (strict,
unknown fields forbidden on /v1/generate; logged and ignored on the OpenAI routes unless
``strict_request_fields``); nothing a client sends is ever unpickled or evaluated.  Every route but
/health, /stats and /metrics is bounded in open requests, per replica and per client (``ray_attn/serve/admission.py``),
and every error of every route, FastAPI's own included, has the body of ``ray_attn/serve/http.py``.
"""


import logging
import time
import uuid
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from ray import serve

from ray_attn.serve.admission import Admission, AdmissionMiddleware
from ray_attn.serve.auth import Auth, AuthMiddleware
from ray_attn.serve.api_servers import keep_from_replica
from ray_attn.serve.proxy_auth import publish_from_replica
from ray_attn.serve.generate import generate
from ray_attn.serve.health import ReplicaHealth
from ray_attn.serve.http import HTTPError, error_responses, install_error_handlers
from ray_attn.serve.ingress import REPLICA_HEADER, RoutedHTTPRequest, build_routed_app, run_asgi
from ray_attn.serve.loop import EngineLoop
from ray_attn.serve.lora_adapters import ServedAdapters, adapter_route
from ray_attn.serve.metrics import RayMetricsHooks
from ray_attn.serve.openai.chat import create_chat_completion
from ray_attn.serve.openai.completions import create_completion
from ray_attn.serve.openai.models import list_models
from ray_attn.serve.openai.protocol import ChatCompletionRequest, CompletionRequest
from ray_attn.serve.openai.responses import ModelList
from ray_attn.serve.openai.tokenize import (DetokenizeRequest, DetokenizeResponse, TokenizeChatRequest,
                                            TokenizeCompletionRequest, TokenizeResponse, detokenize, tokenize)
from ray_attn.serve.prometheus import CONTENT_TYPE as PROMETHEUS_TYPE
from ray_attn.serve.request_log import ObservedLoop, RequestLog, RequestMiddleware
from ray_attn.serve.scaling import scaling_options
from ray_attn.serve.schemas import GenerateRequest, GenerateResponse, HealthResponse, ServeAppConfig, StatsResponse

log = logging.getLogger("ray.serve")

fastapi_app = FastAPI(
    title="ray_attn",
    description="Paged FlashAttention LLM serving on Ray: continuous batching across TP workers.",
    version="0.1.0")


# ------------------------------------------------------------------------------------- deployment
# Note: ``@serve.deployment`` serializes the class when this module is imported, so every helper
# the class uses must be defined above it -- and this module must not use ``from __future__ import
# annotations``: FastAPI resolves ``request: Request`` from the annotation object.
def _replica_tag() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside Serve (direct construction in tests)
        return "local"


def _replica_admission() -> Optional[Admission]:
    try:
        return getattr(serve.get_replica_context().servable_object, "admission", None)
    except Exception:  # noqa: BLE001 - outside a replica
        return None


def _replica_server():
    """The replica's LLMServer, or None outside a replica.  Unlike admission, a replica without
    its ``auth`` is an error (500), never a server left open."""
    from ray.serve.exceptions import RayServeException

    try:
        return serve.get_replica_context().servable_object
    except RayServeException:
        return None


def _replica_auth() -> Optional[Auth]:
    server = _replica_server()
    return None if server is None else server.auth


def _replica_requests() -> Optional[RequestLog]:
    server = _replica_server()
    return None if server is None else server.requests


class ReplicaHeaderMiddleware:
    """Names the replica (``X-Replica-Id``) on every answer, behind the front or not: engine ids
    are the HTTP request's own (``request_log.py``), so only this says who ran a request."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        server = _replica_server()
        if scope["type"] != "http" or server is None:
            return await self.app(scope, receive, send)

        async def named(message):
            if message["type"] == "http.response.start":
                message = dict(message, headers=[*message.get("headers", ()), server.replica_header])
            await send(message)

        await self.app(scope, receive, named)


# ``@serve.ingress`` freezes a copy of the app: its middleware and handlers must be in place first.
# Each add_middleware wraps the ones before it, so a request meets them in the reverse order:
# its id and log line first (every answer has them), then the key check, then admission -- a
# request without a valid key is never counted, and its body is never read.
fastapi_app.add_middleware(AdmissionMiddleware, gate_of=_replica_admission)
fastapi_app.add_middleware(AuthMiddleware, auth_of=_replica_auth)
fastapi_app.add_middleware(RequestMiddleware, log_of=_replica_requests)
fastapi_app.add_middleware(ReplicaHeaderMiddleware)
install_error_handlers(fastapi_app)


@serve.deployment
@serve.ingress(fastapi_app)
class LLMServer:
    def __init__(self, app_config: dict):
        from ray_attn.config import EngineConfig
        from ray_attn.engine import LLMEngine

        self.cfg = ServeAppConfig.model_validate(app_config)
        # First: a key file that cannot be read stops the replica before any worker starts.
        self.auth = Auth.from_config(self.cfg)
        engine_cfg: EngineConfig = self.cfg.engine
        self.tokenizer = self._load_tokenizer(self.cfg.tokenizer_folder(), engine_cfg.model.vocab_size)
        if self.tokenizer is not None and not engine_cfg.model.eos_token_ids \
                and self.tokenizer.eos_token_id is not None:
            # A checkpoint without an eos_token_id of its own ends where its tokenizer says.
            model = engine_cfg.model.model_copy(update={"eos_token_ids": [int(self.tokenizer.eos_token_id)]})
            engine_cfg = engine_cfg.model_copy(update={"model": model})
        self.eos_token_ids = list(engine_cfg.model.eos_token_ids)
        self.model_id = self.cfg.model_id()
        self.max_model_len = engine_cfg.model.max_position_embeddings
        self.created = int(time.time())
        self.executor = self._make_executor(engine_cfg)
        try:
            self.engine = LLMEngine(engine_cfg, self.executor)
        except BaseException:
            self.executor.shutdown()
            raise
        replica = _replica_tag()
        # Behind the prefix-aware front a client cannot pick a replica: every answer relayed by
        # handle_http names its replica, so per-replica /stats can be told apart.
        self.replica_header = (REPLICA_HEADER, replica.encode())
        self.metrics = RayMetricsHooks(replica)
        self.auth.on_refused = self.metrics.on_rejected
        # Serve's proxy answers X-Request-ID itself (request_log.py): the app adds it only
        # when its id is not the one the proxy will send.
        self.requests = RequestLog.from_config(self.cfg, self.tokenizer, proxy_echoes_id=True)
        self.admission = Admission(self.cfg.connection_limit, self.cfg.client_limit, self.cfg.retry_after_s,
                                   self.cfg.body_timeout_s, on_refused=self.metrics.on_rejected)
        # The handlers submit through ObservedLoop: engine ids named after the HTTP request's
        # id, tokens counted for its log line and spans.
        self.loop = ObservedLoop(EngineLoop(self.engine, self.cfg.max_in_flight, hooks=self.metrics,
                                            request_id_prefix=f"{replica}-{uuid.uuid4().hex[:6]}").start())
        self.health_state = ReplicaHealth(self.loop.inner, self.engine, self.executor, self.cfg.step_timeout_s,
                                          self.cfg.health_ping_timeout_s)
        self.vocab_size = engine_cfg.model.vocab_size
        # the LoRA adapters, by the names requests use (serve/lora_adapters.py); None: no LoRA
        self.adapters = ServedAdapters(self.cfg, self.model_id, engine_cfg) if engine_cfg.lora_config else None
        # What Serve's proxy needs to refuse unkeyed requests itself (proxy_auth.py): the keys'
        # digests, renewed so that a re-read key file reaches it.  Last: a replica that failed
        # to start publishes nothing.
        self.proxy_auth = publish_from_replica(lambda: self.auth)
        self.api_servers = keep_from_replica(self.cfg.api_server_count)  # more proxies (api_servers.py)
        log.info("ray_attn replica %s ready: TP=%d, %d KV blocks, kernel %s, capacity %d requests",
                 replica, engine_cfg.parallel.tensor_parallel_size, self.executor.num_blocks,
                 getattr(self.executor, "kernel_name", "?"), self.cfg.max_in_flight)

    def _make_executor(self, engine_cfg):
        if self.cfg.executor == "in_process":
            from ray_attn.runtime import InProcessExecutor

            return InProcessExecutor(engine_cfg)
        import ray
        from ray_attn.runtime import AttentionCluster

        # The replica's own placement group: bundle 0 is this actor, bundles 1..tp its ranks.
        pg = ray.util.get_current_placement_group()
        return AttentionCluster(engine_cfg, placement_group=pg, bundle_offset=1 if pg else 0,
                                use_gpu=self.cfg.use_gpu)

    @staticmethod
    def _load_tokenizer(folder: Optional[str], vocab_size: int):
        if not folder:
            return None
        from transformers import AutoTokenizer

        from ray_attn.gguf_file import gguf_path, load_tokenizer

        gguf = gguf_path(folder)  # a GGUF file (or a folder of one): the tokenizer of its metadata
        tok = load_tokenizer(gguf) if gguf else AutoTokenizer.from_pretrained(
            folder, local_files_only=True, trust_remote_code=False)
        if len(tok) > vocab_size:
            raise ValueError(f"tokenizer at {folder!r} has {len(tok)} tokens but the model's "
                             f"vocab_size is {vocab_size}")
        return tok

    # -- lifetime -----------------------------------------------------------------------------
    async def check_health(self) -> None:
        """Serve calls this every health_check_period_s; raising makes Serve replace the replica.
        It waits for a fresh worker ping (``serve/health.py``), which /health then answers from."""
        h = await self.health_state.check()
        if not h.ok:
            raise RuntimeError(h.detail)

    def __del__(self):
        if getattr(self, "proxy_auth", None) is not None:
            self.proxy_auth.close()
        if getattr(self, "api_servers", None) is not None:  # the extras leave once no replica renews them
            self.api_servers.close()
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop()
        tracing = getattr(getattr(self, "requests", None), "tracing", None)
        if tracing is not None:
            tracing.shutdown()  # export the spans still buffered
        ex = getattr(self, "executor", None)
        if ex is not None:
            try:
                ex.shutdown()
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
            self.executor = None

    # -- HTTP -----------------------------------------------------------------------------------
    async def handle_http(self, request: RoutedHTTPRequest) -> AsyncIterator[dict]:
        """This replica's HTTP app on a request the prefix-aware front forwarded over a handle
        (``ingress.py``), its ASGI messages yielded back as the app sends them."""
        async for message in run_asgi(self.app, request.scope_for_app(), request.body):
            yield message  # ReplicaHeaderMiddleware has named the replica

    @fastapi_app.get("/health", response_model=HealthResponse, responses={503: {"model": HealthResponse}})
    async def health(self):
        h = await self.health_state.poll()
        body = HealthResponse(status="ok" if h.ok else "unhealthy", workers=h.workers, detail=h.detail)
        return JSONResponse(body.model_dump(), status_code=200 if h.ok else 503,
                            headers=None if h.ok else {"Retry-After": str(self.cfg.retry_after_s)})

    @fastapi_app.get("/stats", response_model=StatsResponse)
    async def stats(self):
        snap = self.loop.stats()
        snap.update(vocab_size=self.vocab_size, max_prompt_tokens=self.cfg.max_prompt_tokens,
                    max_tokens_limit=self.cfg.max_tokens_limit, **self.admission.stats())
        return StatsResponse.model_validate({k: snap[k] for k in StatsResponse.model_fields}).model_dump()

    @fastapi_app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus_metrics(self):
        return PlainTextResponse(self.metrics.registry.render(), media_type=PROMETHEUS_TYPE)

    @fastapi_app.post("/admin/reload_api_keys", responses=error_responses(401, 404))
    async def reload_api_keys(self):
        """Re-read the key files now (they are also re-read within a second of changing):
        a leaked key dropped from its file stops working at once.  Answers the counts only."""
        if not self.auth.admin.configured:  # the middleware answers 404 first; this is its twin
            return HTTPError(404, [("path", "path: /admin/reload_api_keys does not exist")]).response()
        self.auth.api.reload()
        self.auth.admin.reload()
        return {"api_keys": len(self.auth.api.keys()), "admin_api_keys": len(self.auth.admin.keys())}

    # LoRA adapters (admin scope: auth.py; paths under admin_root), at vLLM's paths and /admin's
    @fastapi_app.post("/v1/load_lora_adapter", responses=error_responses(400, 401, 404))
    @fastapi_app.post("/admin/v1/load_lora_adapter", responses=error_responses(400, 401, 404))
    async def load_lora_adapter(self, request: Request):
        return await self._openai(adapter_route("load"), request)

    @fastapi_app.post("/v1/unload_lora_adapter", responses=error_responses(400, 401, 404))
    @fastapi_app.post("/admin/v1/unload_lora_adapter", responses=error_responses(400, 401, 404))
    async def unload_lora_adapter(self, request: Request):
        return await self._openai(adapter_route("unload"), request)

    @fastapi_app.get("/v1/models", response_model=ModelList)
    async def models(self):
        return list_models(self)

    @fastapi_app.post(
        "/tokenize", response_model=TokenizeResponse, responses=error_responses(400, 404, 413),
        openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": {
            "anyOf": [TokenizeCompletionRequest.model_json_schema(), TokenizeChatRequest.model_json_schema()]}}}}})
    async def tokenize(self, request: Request):
        return await self._openai(tokenize, request)

    @fastapi_app.post(
        "/detokenize", response_model=DetokenizeResponse, responses=error_responses(400, 404, 413),
        openapi_extra={"requestBody": {"required": True, "content": {
            "application/json": {"schema": DetokenizeRequest.model_json_schema()}}}})
    async def detokenize(self, request: Request):
        return await self._openai(detokenize, request)

    @fastapi_app.post(
        "/v1/completions", responses=error_responses(400, 404, 413, 503),
        openapi_extra={"requestBody": {"required": True, "content": {
            "application/json": {"schema": CompletionRequest.model_json_schema()}}}})
    async def completions(self, request: Request):
        return await self._openai(create_completion, request)

    @fastapi_app.post(
        "/v1/chat/completions", responses=error_responses(400, 404, 413, 503),
        openapi_extra={"requestBody": {"required": True, "content": {
            "application/json": {"schema": ChatCompletionRequest.model_json_schema()}}}})
    async def chat_completions(self, request: Request):
        return await self._openai(create_chat_completion, request)

    async def _openai(self, handler, request: Request):
        try:
            return await handler(self, request)
        except HTTPError as e:
            self.metrics.on_rejected(e.status)
            return e.response()

    @fastapi_app.post(
        "/v1/generate", response_model=GenerateResponse, responses=error_responses(),
        openapi_extra={"requestBody": {"required": True, "content": {
            "application/json": {"schema": GenerateRequest.model_json_schema()}}}})
    async def generate(self, request: Request):
        try:
            return await generate(self, request)
        except HTTPError as e:
            self.metrics.on_rejected(e.status)
            return e.response()

# ---------------------------------------------------------------------------------------- builder
def resolve_use_gpu(cfg: ServeAppConfig) -> bool:
    if cfg.use_gpu is not None:
        return cfg.use_gpu
    device = cfg.engine.parallel.device
    if device != "auto":
        return device == "cuda"
    import ray

    if not ray.is_initialized():
        log.warning("parallel.device='auto' and Ray is not connected at build time: assuming CPU. "
                    "Set engine.parallel.device (or use_gpu) explicitly for GPUs.")
        return False
    return ray.cluster_resources().get("GPU", 0) >= 1


def deployment_options(cfg: ServeAppConfig) -> dict[str, Any]:
    """Serve options for one replica = engine + its TP workers, reserved together."""
    use_gpu = resolve_use_gpu(cfg)
    gpu = {"GPU": 1} if use_gpu else {}
    if cfg.executor == "in_process":
        bundles = [{"CPU": cfg.replica_num_cpus, **gpu}]
        actor = {"num_cpus": cfg.replica_num_cpus, **({"num_gpus": 1} if use_gpu else {})}
    else:
        rank = {"CPU": cfg.engine.parallel.num_cpus_per_worker, **gpu}
        bundles = [{"CPU": cfg.replica_num_cpus}] + [dict(rank)
                                                     for _ in range(cfg.engine.parallel.tensor_parallel_size)]
        actor = {"num_cpus": cfg.replica_num_cpus}
    if cfg.replica_resource:  # one unit per replica: a node's amount caps the replicas it holds
        bundles[0] = dict(bundles[0], **{cfg.replica_resource: 1})
    return dict(
        **scaling_options(cfg),  # replicas (fixed or autoscaled) and the request router
        ray_actor_options=actor,
        placement_group_bundles=bundles,
        placement_group_strategy="STRICT_PACK",
        # Admission control is ours (ray_attn/serve/admission.py: 503/429 + Retry-After past
        # max_connections); Serve's slots exceed it so that our bounds bite first and /health and
        # /stats still get in.  Serve's queue behind those slots is unbounded (-1) by default: a
        # bounded one answers its own plain-text 503 to a burst that outruns the refusals, and
        # the refusals (no body read, no handler run) drain the queue as fast as it fills.
        max_ongoing_requests=cfg.connection_limit + cfg.control_headroom,
        max_queued_requests=cfg.max_queued_requests,
        backpressure_config={"retry_after_s": cfg.retry_after_s},
        health_check_period_s=cfg.health_check_period_s,
        health_check_timeout_s=cfg.health_check_timeout_s,
    )


def build_app(args: dict | ServeAppConfig | None = None):
    """Serve app builder (``import_path: ray_attn.serve.app:build_app``); ``args`` is a ServeAppConfig."""
    cfg = args if isinstance(args, ServeAppConfig) else ServeAppConfig.model_validate(args or {})
    cfg = cfg.model_copy(update={"use_gpu": resolve_use_gpu(cfg)})
    llm = LLMServer.options(**deployment_options(cfg))
    if cfg.request_router == "prefix_aware" or cfg.resume_requests:
        return build_routed_app(cfg, llm)
    return llm.bind(cfg.model_dump(mode="json"))
