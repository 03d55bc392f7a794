"""The Serve app's configuration: ``ServeAppConfig`` (the ``args:`` of a Serve YAML) with its
replica-scaling and router settings, and the readers of config files.

Apart from ``schemas.py`` (the HTTP bodies) because scripts and the CLI read app configs without
touching a request model, and each of the two grows with its own concerns.
"""

from __future__ import annotations

import os
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_serializer, field_validator, model_validator

from ray_attn.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from ray_attn.structured_output import StructuredOutputsConfig

# A credential longer than this is refused without comparing it: no key is that long, and a
# client may send a 1 MB header (uvicorn's httptools parser lets one through to the app).
MAX_KEY_CHARS = 512


def check_key(key: str, where: str) -> str:
    """``key`` if a client could send it as a bearer token: visible ASCII without spaces (HTTP
    strips surrounding whitespace from a header, so a key that holds some could never match).
    The error names where the key came from, never the key."""
    if not key:
        raise ValueError(f"{where}: empty key")
    if len(key) > MAX_KEY_CHARS:
        raise ValueError(f"{where}: a key longer than {MAX_KEY_CHARS} characters")
    if not all("\x21" <= c <= "\x7e" for c in key):
        raise ValueError(f"{where}: a key may hold only visible ASCII characters, no spaces "
                         f"(HTTP strips surrounding whitespace: such a key could never match)")
    return key


# ------------------------------------------------------------------------------------- app config
def default_engine_config() -> EngineConfig:
    """A small random-weight model with two real TP workers on CPU: light enough for 2 cores."""
    return EngineConfig(
        model=ModelConfig.from_name("serve-cpu"),
        cache=CacheConfig(num_blocks=512, block_size=16),
        parallel=ParallelConfig(tensor_parallel_size=2, device="cpu", num_cpus_per_worker=0.5),
        max_num_seqs=32, max_num_batched_tokens=1024)


class AutoscalingSpec(BaseModel):
    """Serve's autoscaling of the LLMServer deployment (``autoscaling_config`` of the app args).
    Each replica Serve adds is a whole engine with its own placement group (replica + TP ranks)."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=0, description="Fewest replicas; 0 lets the app scale to zero "
                                                   "when idle (the first request then waits for one).")
    max_replicas: int = Field(2, ge=1, description="Most replicas; each needs its own replica bundle "
                                                   "and TP bundles on one node.")
    target_ongoing_requests: Optional[float] = Field(
        None, gt=0, description="Requests in flight per replica that Serve steers towards (it adds "
                                "replicas above it, removes them below). Unset: engine.max_num_seqs, "
                                "one full running batch per replica.")
    upscale_delay_s: float = Field(30.0, ge=0, description="How long load must stay above target "
                                                           "before Serve adds a replica.")
    downscale_delay_s: float = Field(600.0, ge=0, description="How long load must stay below target "
                                                              "before Serve removes a replica.")

    @model_validator(mode="after")
    def _check(self):
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas: {self.max_replicas} is below min_replicas "
                             f"({self.min_replicas})")
        return self


class PrefixRouterConfig(BaseModel):
    """Settings of the front deployment: the prefix-cache-aware router (``request_router:
    prefix_aware``), also the front that resumes requests (``resume_requests``)."""

    model_config = ConfigDict(extra="forbid")

    imbalanced_threshold: int = Field(
        8, ge=0, description="Largest lead, in requests in flight, that the replica holding a "
                             "request's prefix may have over the least loaded replica and still get "
                             "the request; beyond it the request goes by power-of-two choices.")
    min_match_blocks: int = Field(
        1, ge=1, description="Full prompt blocks a replica must already hold for the request to "
                             "prefer it.")
    max_blocks_per_replica: Optional[int] = Field(
        None, gt=0, description="Block hashes remembered per replica (least recently routed "
                                "forgotten first). Unset: engine.cache.num_blocks, or 65536 when the "
                                "cache is sized from GPU memory.")
    ingress_num_cpus: float = Field(0.25, gt=0, description="CPUs of the front deployment that "
                                                            "reads bodies and forwards requests.")
    ingress_num_replicas: int = Field(
        1, ge=1, description="Replicas of the front deployment. Serve spreads them over nodes; with "
                             "resume_requests and 2 or more, a stream whose front replica is lost is "
                             "resumed by another one when the client reconnects (Last-Event-ID).")
    ingress_max_replicas_per_node: Optional[int] = Field(
        None, ge=1, description="At most this many front replicas per node (Serve's "
                                "max_replicas_per_node): 1 keeps a node's loss to one front replica. "
                                "Unset: Serve's soft spread only.")
    ingress_max_ongoing_requests: int = Field(
        1024, ge=1, description="Requests the front deployment holds at once (it only forwards; "
                                "admission stays with the replicas).")
    ingress_resources: dict[str, float] = Field(
        default_factory=dict, description="Custom resources the front deployment asks for, e.g. one "
                                          "only the head node has: the front holds every request's "
                                          "body, so resumption needs it on a node that stays.")


class ServeAppConfig(BaseModel):
    """The ``args:`` of the Serve app (``ray_attn.serve.app:build_app``): the engine plus the HTTP limits."""

    # It may hold API keys: a validation error names the field, never the value it was given
    # (pydantic's own message would print a misspelt `api_key: sk-...` whole).
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    engine: EngineConfig = Field(default_factory=default_engine_config,
                                 description="The engine each replica runs (model, KV cache, TP layout).")
    executor: Literal["ray", "in_process"] = Field(
        "ray", description="'ray': one Ray actor per TP rank, placed in the replica's own placement "
                           "group; 'in_process': TP=1 inside the replica process, no worker actors.")
    tokenizer: Optional[str] = Field(
        None, description="Local folder with a Hugging Face tokenizer (and its chat template); enables "
                          "text prompts, text in responses, stop strings and chat. Default: the "
                          "checkpoint folder when it holds a tokenizer. Local files only, no remote code.")
    served_model_name: Optional[str] = Field(
        None, description="The `model` name of the OpenAI endpoints (GET /v1/models); default: the "
                          "checkpoint folder's name, else 'ray_attn-random'.")
    max_choices: int = Field(16, gt=0, description="Most completions one OpenAI request may ask for "
                                                   "(prompts x n).")
    max_prompt_tokens: int = Field(1024, gt=0, description="Longest prompt accepted, in tokens.")
    max_tokens_limit: int = Field(256, gt=0, description="Largest `max_tokens` a request may ask for.")
    max_stop_token_ids: int = Field(16, ge=0, description="Most entries in a request's `stop` list.")
    tool_call_parser: Optional[Literal["hermes", "llama3_json", "mistral"]] = Field(
        None, description="How tool calls are read out of the model's text with tool_choice auto "
                          "(vLLM's --tool-call-parser): hermes (Hermes, Qwen), llama3_json, mistral. "
                          "Unset: auto is refused; required and named calls still work.")
    structured_outputs: StructuredOutputsConfig = Field(
        default_factory=StructuredOutputsConfig, description="Structured outputs (vLLM's "
        "structured_outputs_config): `backend` xgrammar, guidance or auto.")
    strict_request_fields: bool = Field(
        False, description="Answer 400 naming the field to an OpenAI request with a field no schema "
                           "defines. Default: log it and ignore it, as vLLM does (clients send "
                           "fields of newer API versions and of other servers).")
    max_queue_depth: int = Field(
        64, ge=0, description="Requests that may wait beyond the engine's running batch "
                              "(engine.max_num_seqs). Past max_num_seqs + max_queue_depth requests "
                              "in flight, a new one gets 503 with Retry-After.")
    max_body_bytes: int = Field(1 << 20, gt=0, description="Largest request body, in bytes (413 beyond).")
    retry_after_s: int = Field(1, ge=0, description="Retry-After seconds sent with every 503 and 429.")
    body_timeout_s: float = Field(
        30.0, gt=0, allow_inf_nan=False,
        description="A request body must arrive in full within this many seconds of its handler "
                    "starting to read it, else 408 and the connection is closed: a client that "
                    "stalls mid-body must not hold its connection slot for as long as it likes.")
    max_connections: Optional[int] = Field(
        None, gt=0, description="Requests one replica holds open at once (every route but /health "
                                "and /stats), counted from the moment the app gets them -- a client "
                                "still sending its body counts -- until the response is sent; one "
                                "more gets 503 + Retry-After at once. At least max_num_seqs + "
                                "max_queue_depth. Default: twice that.")
    max_requests_per_client: Optional[int] = Field(
        None, gt=0, description="Of max_connections, how many one client address may hold; one more "
                                "gets 429 + Retry-After at once. Default: half of max_connections. "
                                "Behind a proxy on another host every request has the proxy's "
                                "address: raise it to max_connections there.")
    replica_num_cpus: float = Field(1.0, gt=0, description="CPUs of the replica's own bundle (bundle 0).")
    replica_resource: Optional[str] = Field(
        None, min_length=1, description="A custom node resource each replica takes one unit of (in its "
                                        "bundle 0): start each node with e.g. --resources "
                                        "'{\"ray_attn_replica\": 1}' to hold at most that many replicas per "
                                        "node, so replicas spread over nodes. Serve's own "
                                        "max_replicas_per_node cannot be combined with the placement "
                                        "group each replica reserves for its ranks.")
    num_replicas: Optional[int] = Field(
        None, gt=0, description="A fixed number of replicas, each an engine plus its TP workers "
                                "(1 when neither this nor autoscaling_config is given).")
    autoscaling_config: Optional[AutoscalingSpec] = Field(
        None, description="Let Serve scale the replicas with load; excludes num_replicas.")
    request_router: Literal["default", "prefix_aware"] = Field(
        "default", description="'default': Serve's power-of-two choices by queue length, HTTP "
                               "straight to the replicas; 'prefix_aware': a front deployment reads "
                               "each prompt and sends it to the replica that holds its prefix "
                               "(ray_attn/serve/router.py).")
    resume_requests: bool = Field(
        False, description="Put a front deployment before the replicas (also with the default router) "
                           "that sends a request whose replica was lost to another one: a request "
                           "not yet answered is sent again, and a stream goes on where it stopped, "
                           "each token reaching the client once (ray_attn/serve/resume.py).")
    max_request_attempts: int = Field(
        3, ge=1, description="With resume_requests: replicas one request may try, the first included.")
    retry_timeout_s: float = Field(
        60.0, gt=0, description="With resume_requests: how long a retried request may wait for a replica "
                                "(none left: Serve would hold it until one comes back) before it ends "
                                "with an error event, or a 503 when nothing was sent yet.")
    resume_window_s: float = Field(
        60.0, gt=0, description="With resume_requests: how long after its last event a stream's log "
                                "is kept for a client that reconnects (Last-Event-ID) to another front "
                                "replica (ray_attn/serve/progress_store.py).")
    prefix_router: PrefixRouterConfig = Field(
        default_factory=PrefixRouterConfig, description="Settings of the prefix-aware router.")
    use_gpu: Optional[bool] = Field(
        None, description="Give each rank's bundle a GPU; when unset, true iff engine.parallel.device "
                          "is 'cuda' (or 'auto' on a cluster with GPUs).")
    control_headroom: int = Field(
        1024, ge=1, description="Serve slots per replica above max_connections (max_ongoing_requests = "
                                "max_connections + this), so that /health and /stats, and requests "
                                "being refused with 503/429, reach the replica at once when it is "
                                "full instead of waiting in Serve's queue behind a burst.")
    max_queued_requests: int = Field(
        -1, ge=-1, description="Serve's own queue in front of the replicas (requests beyond every "
                               "replica's max_ongoing_requests). -1, the default: unbounded, so that "
                               "Serve never refuses a request itself and every refusal is our JSON "
                               "503/429 (a full replica refuses at once, which keeps the queue short). "
                               "A bound brings back Serve's plain-text 503 past it.")
    health_check_period_s: float = Field(10.0, gt=0, description="How often Serve calls check_health.")
    health_check_timeout_s: float = Field(30.0, gt=0, description="How long one check_health may take.")
    step_timeout_s: float = Field(120.0, gt=0, description="A step running longer than this fails "
                                                            "check_health (a hung rank or collective).")
    health_ping_timeout_s: float = Field(10.0, gt=0, description="How long check_health waits for the "
                                                                 "workers' ping.")

    # -- exposing the server (ray_attn/serve/auth.py, request_log.py, tracing.py; docs/serving.md)
    api_keys: list[SecretStr] = Field(
        default_factory=list, description="Keys a request may send as `Authorization: Bearer <key>` "
        "(vLLM's --api-key); several may be valid at once, for rotation. Once any key is configured "
        "(here, api_key_file or api_key_env), every route but /health needs one (401 + "
        "WWW-Authenticate: Bearer). Keys written here travel in the app's config: prefer the file "
        "or the environment variable.")
    api_key_file: Optional[str] = Field(
        None, description="A file of keys, one per line ('#' comments), read on the replica's node "
                          "and re-read when it changes (rotation without a restart).")
    api_key_env: Optional[str] = Field(
        "RAY_ATTN_API_KEY", description="An environment variable of the replica's process holding "
                                        "keys, comma-separated (vLLM's VLLM_API_KEY); null: none.")
    admin_api_keys: list[SecretStr] = Field(
        default_factory=list, description="Keys of the admin routes (/admin/...), which are off (404) "
                                          "unless an admin key is configured; an API key does not open them.")
    admin_api_key_file: Optional[str] = Field(None, description="A file of admin keys, as api_key_file.")
    admin_api_key_env: Optional[str] = Field(
        "RAY_ATTN_ADMIN_API_KEY", description="An environment variable holding admin keys, comma-separated.")
    admin_root: Optional[str] = Field(
        None, description="The folder under which every path an admin route takes must lie (no '..', "
                          "no symlink out of it): adapter files, once they can be loaded.")
    lora_modules: dict[str, str] = Field(default_factory=dict, description=(
        "LoRA adapters served from the start, name -> PEFT folder (vLLM's --lora-modules name=path): "
        "requests name one as model='<adapter>' or '<served model>:<adapter>'. Needs engine.lora_config "
        "(set to the defaults when unset)."))
    dynamic_lora_loading_path: Optional[str] = Field(None, description=(
        "Ray Serve LLM's: a folder (or an fsspec URL, with fsspec installed) of adapter folders; a "
        "request naming an adapter not loaded yet loads <path>/<adapter> on first use."))
    public_metrics: bool = Field(
        False, description="With API keys: answer /metrics and /stats without a key (a scraper on a "
                           "private network). Default: they need a key like every route but /health.")
    api_server_count: int = Field(
        1, ge=1, le=64, description="HTTP proxies on each node's Serve port (vLLM's --api-server-count): "
        "Serve's own and api_server_count - 1 more (serve/api_servers.py), which share new connections "
        "through SO_REUSEPORT, so that a flood of connections is parsed and refused on several cores.")
    log_requests: Literal["off", "summary", "full"] = Field(
        "summary", description="One log line per request: id, client address, status, tokens in and "
                               "out, time ('summary'); also the prompt and the output ('full'); none "
                               "('off', vLLM's --disable-log-requests).")
    otlp_traces_endpoint: Optional[str] = Field(
        None, description="Send OpenTelemetry spans per request (queue, prefill, decode, resume) to "
                          "this OTLP/HTTP endpoint, e.g. http://localhost:4318 (pip install "
                          "'ray_attn[otel]'). Default: no tracing, at no cost.")

    @field_serializer("api_keys", "admin_api_keys")
    def _reveal(self, keys: list[SecretStr]) -> list[str]:
        # A dump is how the config reaches the replicas (build_app binds it); only reprs and
        # errors mask the keys.  A masked dump read back would make '**********' a key.
        return [k.get_secret_value() for k in keys]

    @field_validator("api_keys", "admin_api_keys")
    @classmethod
    def _check_keys(cls, keys: list[SecretStr], info) -> list[SecretStr]:
        for i, k in enumerate(keys):
            check_key(k.get_secret_value(), f"{info.field_name}[{i}]")
        return keys

    @model_validator(mode="after")
    def _check(self):
        if (self.lora_modules or self.dynamic_lora_loading_path) and self.engine.lora_config is None:
            from ray_attn.lora import LoRAConfig

            object.__setattr__(self, "engine", self.engine.model_copy(update={"lora_config": LoRAConfig()}))
        for name in self.lora_modules:
            if not name or ":" in name or name == self.model_id():
                raise ValueError(f"lora_modules: adapter name {name!r} must be non-empty, without ':', and not "
                                 "the served model's name")
        tp = self.engine.parallel.tensor_parallel_size
        if self.executor == "in_process" and tp != 1:
            raise ValueError(f"executor='in_process' runs tensor_parallel_size=1 only, got {tp}")
        if self.num_replicas is not None and self.autoscaling_config is not None:
            raise ValueError("num_replicas: give either a fixed num_replicas or autoscaling_config, "
                             "not both")
        target = self.autoscaling_config and self.autoscaling_config.target_ongoing_requests
        if target and target > self.max_in_flight:
            raise ValueError(f"autoscaling_config.target_ongoing_requests: {target:g} is above what a "
                             f"replica admits (max_num_seqs + max_queue_depth = {self.max_in_flight})")
        if self.max_connections is not None and self.max_connections < self.max_in_flight:
            raise ValueError(f"max_connections: {self.max_connections} is below max_num_seqs + "
                             f"max_queue_depth = {self.max_in_flight}: the engine could never fill; "
                             f"lower max_queue_depth instead")
        if self.max_requests_per_client is not None and self.max_requests_per_client > self.connection_limit:
            raise ValueError(f"max_requests_per_client: {self.max_requests_per_client} exceeds "
                             f"max_connections = {self.connection_limit}")
        return self

    def tokenizer_folder(self) -> Optional[str]:
        """Where the tokenizer comes from: ``tokenizer``, else the checkpoint's own (a GGUF file's
        metadata holds one)."""
        if self.tokenizer:
            return self.tokenizer
        ckpt = self.engine.checkpoint
        from ray_attn.gguf_file import gguf_path

        if ckpt and gguf_path(ckpt):
            return gguf_path(ckpt)
        if ckpt and any(os.path.exists(os.path.join(ckpt, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
            return ckpt
        return None

    def model_id(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        ckpt = self.engine.checkpoint
        return os.path.basename(os.path.normpath(ckpt)) if ckpt else "ray_attn-random"

    @property
    def max_in_flight(self) -> int:
        return self.engine.max_num_seqs + self.max_queue_depth

    @property
    def connection_limit(self) -> int:
        """max_connections, or its default."""
        return self.max_connections or 2 * self.max_in_flight

    @property
    def client_limit(self) -> int:
        """max_requests_per_client, or its default."""
        return self.max_requests_per_client or max(1, self.connection_limit // 2)


# ------------------------------------------------------------------------------------ files
def app_args_from_file(path: str) -> dict:
    """The app args in a JSON/YAML file: a ``serve run`` config (its first application's
    ``args``), app args themselves, or a bare engine config (returned as ``{"engine": ...}``)."""
    import json
    from pathlib import Path

    text = Path(path).read_text()
    if path.endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text) or {}
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    if "applications" in data:
        data = (data["applications"] or [{}])[0].get("args") or {}
    if data and set(data) <= set(EngineConfig.model_fields):  # an engine config on its own
        return {"engine": data}
    return data


def engine_config_from_file(path: str) -> EngineConfig:
    """The EngineConfig in any file ``app_args_from_file`` reads (the default engine when it has none)."""
    engine = app_args_from_file(path).get("engine")
    return EngineConfig.model_validate(engine) if engine is not None else default_engine_config()
