"""Pydantic models of the Serve app's HTTP request and response bodies (its config is in
``app_config.py``, re-exported here).

Every request model forbids unknown fields and runs in strict mode (``"5"`` is not an int, ``1``
is not a bool), so that a wrong type is answered with a 4xx naming the field instead of being
coerced.  Limits that depend on the deployment (prompt length, max_tokens, queue depth, body size)
live in :class:`ServeAppConfig` and are checked by the app after parsing.
"""

from __future__ import annotations

import os

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ray_attn.serve.app_config import (  # noqa: F401  (re-exported: the app config's old home)
    AutoscalingSpec,
    PrefixRouterConfig,
    ServeAppConfig,
    app_args_from_file,
    default_engine_config,
    engine_config_from_file,
)

INT64_MAX = 2**63 - 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


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
    lora_path: Optional[str] = Field(None, max_length=4096, description=(
        "A PEFT adapter folder this line runs under (lines naming one folder share it); None: the base model."))
    lora_name: Optional[str] = Field(None, max_length=256, description="The adapter's name (default: its folder's).")

    def lora_request(self, ids: dict):
        """This line's ``LoRARequest`` (ids handed out by ``ids``, one per folder), or None."""
        if self.lora_path is None:
            return None
        from ray_attn.lora import LoRARequest

        name = self.lora_name or os.path.basename(os.path.normpath(self.lora_path))
        key = (name, self.lora_path)
        if key not in ids:
            ids[key] = LoRARequest(name, len(ids) + 1, self.lora_path)
        return ids[key]


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
    # speculative decoding (engine.speculative_config; zeros without it), vLLM's SpecDecodingStats
    spec_decode_num_drafts: int = Field(description="Request-steps that verified draft tokens.")
    spec_decode_num_draft_tokens: int = Field(description="Draft tokens proposed.")
    spec_decode_num_accepted_tokens: int = Field(description="Draft tokens accepted.")
    spec_decode_num_accepted_tokens_per_pos: list[int] = Field(
        description="Draft tokens accepted at each draft position (0 first).")
    spec_decode_mean_acceptance_length: float = Field(
        description="Tokens a speculating request emitted per step: 1 + accepted / drafts (0 before any).")


# ------------------------------------------------------------------------------ deployment limits
def limit_errors(req: GenerateRequest, prompt_token_ids: list[int], *, vocab_size: int,
                 max_model_len: int, max_prompt_tokens: int, max_tokens_limit: int,
                 max_stop_token_ids: int) -> list[tuple[str, str]]:
    """The (field, message) pairs for every deployment limit ``req`` breaks; empty when it fits.

    ``prompt_token_ids`` is the prompt after tokenization (the ``prompt`` field when text was
    sent), so errors about it name whichever field the client used."""
    pfield = "prompt_token_ids" if req.prompt_token_ids is not None else "prompt"
    n = len(prompt_token_ids)
    # text prompts are the tokenizer's ids, which fit the vocabulary by construction
    errs = prompt_errors(prompt_token_ids, pfield, max_prompt_tokens,
                         vocab_size if req.prompt_token_ids is not None else None)
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
        errs += out_of_vocab(req.stop, "stop", vocab_size)
    return errs


def out_of_vocab(ids, field: str, vocab_size: int) -> list[tuple[str, str]]:
    """The first id outside [0, vocab_size) as a (``field[i]``, message) pair; [] when all fit."""
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            return [(f"{field}[{i}]", f"{field}[{i}]: token id {t} is outside the vocabulary [0, {vocab_size})")]
    return []


def prompt_errors(ids, field: str, max_prompt_tokens: int, vocab_size: int | None) -> list[tuple[str, str]]:
    """An empty or over-long prompt, else (with ``vocab_size``) its first out-of-vocabulary id."""
    if not ids:
        return [(field, f"{field}: the prompt is empty after tokenization")]
    if len(ids) > max_prompt_tokens:
        return [(field, f"{field}: {len(ids)} tokens exceeds the limit of {max_prompt_tokens} "
                        f"(max_prompt_tokens)")]
    return out_of_vocab(ids, field, vocab_size) if vocab_size is not None else []


def field_name(loc: tuple) -> str:
    """``('prompt_token_ids', 3)`` -> ``'prompt_token_ids[3]'``; ``()`` -> ``'body'``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


def validation_errors(exc, model: type[BaseModel] = GenerateRequest) -> list[tuple[str, str]]:
    """A pydantic ValidationError as (field, message) pairs whose message starts with the field."""
    out = []
    for e in exc.errors(include_url=False):
        field = field_name(tuple(e.get("loc", ())))
        msg = str(e.get("msg", "invalid"))
        if e.get("type") == "value_error":
            msg = msg.removeprefix("Value error, ")
            head = msg.split(":", 1)[0]
            if field == "body" and head in model.model_fields:
                field, msg = head, msg.split(":", 1)[1].strip()
        elif e.get("type") == "extra_forbidden":
            msg = f"unknown field (allowed: {', '.join(model.model_fields)})"
        elif e.get("type") == "json_invalid":
            msg = f"malformed JSON: {msg.removeprefix('Invalid JSON: ')}"
        elif e.get("type") == "model_type":
            msg = "the body must be a JSON object"
        out.append((field, f"{field}: {msg}"))
    return out
