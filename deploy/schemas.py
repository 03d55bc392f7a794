"""Pydantic models of the Serve app: its config, and the HTTP request and response bodies.

Every request model forbids unknown fields and runs in strict mode (``"5"`` is not an int, ``1``
is not a bool), so that a wrong type is answered with a 4xx naming the field instead of being
coerced.  Limits that depend on the deployment (prompt length, max_tokens, queue depth, body size)
live in :class:`ServeAppConfig` and are checked by the app after parsing.
"""

from __future__ import annotations

import os
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ray_attn.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig

INT64_MAX = 2**63 - 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


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
    """Settings of the prefix-cache-aware router (``request_router: prefix_aware``)."""

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
    ingress_max_ongoing_requests: int = Field(
        1024, ge=1, description="Requests the front deployment holds at once (it only forwards; "
                                "admission stays with the replicas).")


class ServeAppConfig(BaseModel):
    """The ``args:`` of the Serve app (``deploy.app:build_app``): the engine plus the HTTP limits."""

    model_config = ConfigDict(extra="forbid")

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
    num_replicas: Optional[int] = Field(
        None, gt=0, description="A fixed number of replicas, each an engine plus its TP workers "
                                "(1 when neither this nor autoscaling_config is given).")
    autoscaling_config: Optional[AutoscalingSpec] = Field(
        None, description="Let Serve scale the replicas with load; excludes num_replicas.")
    request_router: Literal["default", "prefix_aware"] = Field(
        "default", description="'default': Serve's power-of-two choices by queue length, HTTP "
                               "straight to the replicas; 'prefix_aware': a front deployment reads "
                               "each prompt and sends it to the replica that holds its prefix "
                               "(deploy/router.py).")
    prefix_router: PrefixRouterConfig = Field(
        default_factory=PrefixRouterConfig, description="Settings of the prefix-aware router.")
    use_gpu: Optional[bool] = Field(
        None, description="Give each rank's bundle a GPU; when unset, true iff engine.parallel.device "
                          "is 'cuda' (or 'auto' on a cluster with GPUs).")
    control_headroom: int = Field(
        32, ge=1, description="Serve slots per replica above max_connections (max_ongoing_requests = "
                              "max_connections + this), so that /health and /stats, and requests "
                              "being refused with 503/429, still reach the replica when it is full.")
    max_queued_requests: int = Field(
        64, ge=1, description="Serve's own bounded queue in front of the replicas (requests beyond "
                              "every replica's max_ongoing_requests); past it Serve answers 503 in "
                              "plain text (with Retry-After) itself. Reached only when more than "
                              "control_headroom + this requests arrive faster than a full replica "
                              "refuses them.")
    health_check_period_s: float = Field(10.0, gt=0, description="How often Serve calls check_health.")
    health_check_timeout_s: float = Field(30.0, gt=0, description="How long one check_health may take.")
    step_timeout_s: float = Field(120.0, gt=0, description="A step running longer than this fails "
                                                            "check_health (a hung rank or collective).")
    health_ping_timeout_s: float = Field(10.0, gt=0, description="How long check_health waits for the "
                                                                 "workers' ping.")

    @model_validator(mode="after")
    def _check(self):
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
        if self.tokenizer:
            return self.tokenizer
        ckpt = self.engine.checkpoint
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


# --------------------------------------------------------------------------------------- requests
class GenerateRequest(_Strict):
    """``POST /v1/generate``.  Give exactly one of ``prompt_token_ids`` and ``prompt``."""

    prompt_token_ids: Optional[list[int]] = Field(
        None, min_length=1, description="The prompt as token ids, each in [0, vocab_size).")
    prompt: Optional[str] = Field(
        None, min_length=1, description="The prompt as text; only when the server has a tokenizer.")
    max_tokens: int = Field(16, ge=1, description="Tokens to generate at most (server limit: "
                                                  "max_tokens_limit).")
    temperature: float = Field(0.0, ge=0.0, le=100.0, allow_inf_nan=False,
                               description="0 is greedy; above 0 samples from softmax(logits / T).")
    seed: Optional[int] = Field(None, ge=0, le=INT64_MAX,
                                description="Sampling seed: the same seed gives the same tokens, "
                                            "whatever else is in the batch.")
    stop: list[int] = Field(default_factory=list,
                            description="Stop token ids: generation ends after emitting one of them.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=-1, description="Sample from the k most likely tokens; 0 or -1: all.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Drop tokens below min_p x the top probability.")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="OpenAI's, on output tokens.")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="OpenAI's, on output token counts.")
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description="On prompt and output tokens; 1 is off.")
    min_tokens: int = Field(0, ge=0, description="EOS and stop ids are masked until this many tokens are out.")
    ignore_eos: bool = Field(False, description="Keep generating past the model's EOS.")
    stream: bool = Field(False, description="Answer with server-sent events, one per engine step "
                                            "that made tokens for this request.")

    def sampling_params(self):
        """The engine's SamplingParams; a combination it refuses raises ValueError starting with
        the field's name (e.g. min_tokens above max_tokens)."""
        from ray_attn.request import SamplingParams

        return SamplingParams(
            max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, seed=self.seed, stop_token_ids=tuple(self.stop),
            min_tokens=self.min_tokens, ignore_eos=self.ignore_eos)

    @model_validator(mode="after")
    def _one_prompt(self):
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens: {self.min_tokens} exceeds max_tokens={self.max_tokens}")
        if (self.prompt_token_ids is None) == (self.prompt is None):
            both = "both" if self.prompt is not None else "neither"
            raise ValueError(f"prompt_token_ids: give exactly one of prompt_token_ids or prompt "
                             f"({both} given)")
        return self


class BatchRecord(GenerateRequest):
    """One line of the batch script's JSONL input: a generate request plus an optional id."""

    id: Optional[str] = Field(None, max_length=256, description="Copied to the output line.")
    stream: bool = Field(False, description="Ignored in batch input.")


# -------------------------------------------------------------------------------------- responses
class Usage(BaseModel):
    prompt_tokens: int = Field(description="Tokens in the prompt.")
    completion_tokens: int = Field(description="Tokens generated.")


class GenerateResponse(BaseModel):
    id: str = Field(description="Server-assigned request id.")
    token_ids: list[int] = Field(description="The generated token ids.")
    text: Optional[str] = Field(None, description="The generated text, when a tokenizer is configured.")
    finish_reason: str = Field(description="'length', 'stop', 'abort' or 'error'.")
    error: Optional[str] = Field(None, description="Why the request ended with finish_reason 'error'.")
    usage: Usage = Field(description="Token counts.")


class StreamEvent(BaseModel):
    """One server-sent event (``data: {...}``); the stream ends with ``data: [DONE]``."""

    id: str = Field(description="Server-assigned request id.")
    index: int = Field(description="Position of token_ids[0] in the generated sequence.")
    token_ids: list[int] = Field(description="Tokens made since the previous event.")
    text: Optional[str] = Field(None, description="Text of these tokens, when a tokenizer is configured.")
    finished: bool = Field(description="True on the last event.")
    finish_reason: Optional[str] = Field(None, description="Set on the last event.")
    error: Optional[str] = Field(None, description="Set when the request ended with an error.")


class FieldError(BaseModel):
    field: str = Field(description="Dotted path of the offending field ('body' for the whole body).")
    message: str = Field(description="What is wrong with it.")


class OpenAIError(BaseModel):
    message: str = Field(description="Same as `detail`.")
    type: str = Field(description="'invalid_request_error', 'not_found_error', 'rate_limit_error' "
                                  "(429), 'service_unavailable' or 'server_error'.")
    param: Optional[str] = Field(None, description="Same as `field`.")
    code: int = Field(description="The HTTP status.")


class ErrorResponse(BaseModel):
    """Every error of every route: OpenAI's ``{"error": {...}}`` (which the openai client reads)
    and our ``detail``/``field``/``errors`` side by side, so either kind of client finds its keys."""

    error: OpenAIError = Field(description="OpenAI's error object.")
    detail: str = Field(description="Human-readable message; starts with the field name.")
    field: str = Field(description="The first offending field.")
    errors: list[FieldError] = Field(default_factory=list, description="Every problem found (at most "
                                                                       "MAX_ERRORS).")


class HealthResponse(BaseModel):
    status: Literal["ok", "unhealthy"] = Field(description="'ok' when the engine loop runs and every worker answers.")
    workers: int = Field(description="TP workers that answered the ping.")
    detail: Optional[str] = Field(None, description="Why the replica is unhealthy.")


class StatsResponse(BaseModel):
    kv_blocks_total: int = Field(description="KV blocks per rank.")
    kv_blocks_used: int = Field(description="Blocks referenced by running requests.")
    kv_blocks_free: int = Field(description="Free blocks (cached prefix blocks count as free).")
    kv_blocks_cached: int = Field(description="Free blocks still holding a reusable prefix.")
    kv_usage: float = Field(description="kv_blocks_used / kv_blocks_total.")
    prefix_cache_hit_rate: float = Field(description="Prompt tokens found in the prefix cache / tokens looked up.")
    prefix_cache_hits: int = Field(description="Prompt tokens served from the prefix cache.")
    prefix_cache_queries: int = Field(description="Prompt tokens looked up in the prefix cache.")
    cascade_rate: float = Field(description="Share of engine steps that used cascade attention.")
    local_rate: float = Field(description="Share of engine steps that used local (chunked) attention.")
    steps: int = Field(description="Engine steps since start.")
    steps_per_s: float = Field(description="Engine steps per second over the last window.")
    tokens_generated: int = Field(description="Tokens generated since start.")
    tokens_per_s: float = Field(description="Tokens generated per second over the last window.")
    window_s: float = Field(description="Length of the rate window, in seconds.")
    max_batch_size: int = Field(description="Most requests that got a token in one step.")
    preemptions: int = Field(description="Requests preempted (recomputed later) for lack of blocks.")
    recoveries: int = Field(description="Times the engine restarted its TP ranks after a failure.")
    last_recovery_s: Optional[float] = Field(description="Seconds the last rank restart took.")
    engine_dead: Optional[str] = Field(description="Why the engine stopped (ranks kept failing); "
                                                   "null while it serves.")
    queue_depth: int = Field(description="Requests accepted but not yet running.")
    running: int = Field(description="Requests in the engine's running batch.")
    in_flight: int = Field(description="Requests accepted and not yet finished.")
    max_in_flight: int = Field(description="Capacity: beyond it new requests get 503.")
    requests_finished: int = Field(description="Requests finished since start.")
    requests_by_finish_reason: dict[str, int] = Field(
        description="Finished requests by finish reason ('length', 'stop', 'abort', 'error').")
    requests_rejected_full: int = Field(description="Requests answered 503 because the queue was full.")
    connections_open: int = Field(description="Requests the replica holds open (max_connections counts "
                                              "them), a body still arriving included.")
    max_connections: int = Field(description="Bound on connections_open: beyond it new requests get 503.")
    max_requests_per_client: int = Field(description="Bound on one client address's open requests: "
                                                     "beyond it, 429.")
    clients_open: int = Field(description="Client addresses with open requests.")
    requests_rejected_connections: int = Field(description="Requests answered 503 because "
                                                           "max_connections were open.")
    requests_rejected_client: int = Field(description="Requests answered 429 because their client "
                                                      "held max_requests_per_client.")
    engine_alive: bool = Field(description="Whether the engine loop is running.")
    uptime_s: float = Field(description="Seconds since the engine loop started.")
    vocab_size: int = Field(description="The model's vocabulary size (valid token ids are below it).")
    max_prompt_tokens: int = Field(description="Limit on prompt length.")
    max_tokens_limit: int = Field(description="Limit on max_tokens.")


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


# ------------------------------------------------------------------------------ deployment limits
def limit_errors(req: GenerateRequest, prompt_token_ids: list[int], *, vocab_size: int,
                 max_model_len: int, max_prompt_tokens: int, max_tokens_limit: int,
                 max_stop_token_ids: int) -> list[tuple[str, str]]:
    """The (field, message) pairs for every deployment limit ``req`` breaks; empty when it fits.

    ``prompt_token_ids`` is the prompt after tokenization (the ``prompt`` field when text was
    sent), so errors about it name whichever field the client used."""
    errs: list[tuple[str, str]] = []
    pfield = "prompt_token_ids" if req.prompt_token_ids is not None else "prompt"
    n = len(prompt_token_ids)
    if n == 0:
        errs.append((pfield, f"{pfield}: the prompt is empty after tokenization"))
    if n > max_prompt_tokens:
        errs.append((pfield, f"{pfield}: {n} tokens exceeds the limit of {max_prompt_tokens} "
                             f"(max_prompt_tokens)"))
    elif req.prompt_token_ids is not None:
        for i, t in enumerate(prompt_token_ids):
            if not 0 <= t < vocab_size:
                errs.append((f"prompt_token_ids[{i}]", f"prompt_token_ids[{i}]: token id {t} is "
                                                       f"outside the vocabulary [0, {vocab_size})"))
                break
    if req.max_tokens > max_tokens_limit:
        errs.append(("max_tokens", f"max_tokens: {req.max_tokens} exceeds the limit of "
                                   f"{max_tokens_limit} (max_tokens_limit)"))
    elif n and n + req.max_tokens > max_model_len:
        errs.append(("max_tokens", f"max_tokens: prompt of {n} tokens + max_tokens={req.max_tokens} "
                                   f"exceeds the model's {max_model_len}-token context"))
    if len(req.stop) > max_stop_token_ids:
        errs.append(("stop", f"stop: {len(req.stop)} stop token ids exceeds the limit of "
                             f"{max_stop_token_ids} (max_stop_token_ids)"))
    else:
        for i, t in enumerate(req.stop):
            if not 0 <= t < vocab_size:
                errs.append((f"stop[{i}]", f"stop[{i}]: token id {t} is outside the vocabulary "
                                           f"[0, {vocab_size})"))
                break
    return errs


def field_name(loc: tuple) -> str:
    """``('prompt_token_ids', 3)`` -> ``'prompt_token_ids[3]'``; ``()`` -> ``'body'``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


_KNOWN_FIELDS = tuple(GenerateRequest.model_fields) + ("id",)


def validation_errors(exc, model: type[BaseModel] = GenerateRequest) -> list[tuple[str, str]]:
    """A pydantic ValidationError as (field, message) pairs whose message starts with the field."""
    out = []
    for e in exc.errors(include_url=False):
        field = field_name(tuple(e.get("loc", ())))
        msg = str(e.get("msg", "invalid"))
        if e.get("type") == "value_error":
            msg = msg.removeprefix("Value error, ")
            head = msg.split(":", 1)[0]
            if field == "body" and (head in _KNOWN_FIELDS or head in model.model_fields):
                field, msg = head, msg.split(":", 1)[1].strip()
        elif e.get("type") == "extra_forbidden":
            msg = f"unknown field (allowed: {', '.join(model.model_fields)})"
        elif e.get("type") == "json_invalid":
            msg = f"malformed JSON: {msg.removeprefix('Invalid JSON: ')}"
        elif e.get("type") == "model_type":
            msg = "the body must be a JSON object"
        out.append((field, f"{field}: {msg}"))
    return out
