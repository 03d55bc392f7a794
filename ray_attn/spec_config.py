"""Speculative decoding's configuration (vLLM's ``SpeculativeConfig`` names), validated on the driver.

A proposer guesses up to ``num_speculative_tokens`` next tokens of a decoding request; the target
model verifies them all in one step, as a query of 1 + k tokens over the paged KV (the planner
already plans multi-token queries for chunked prefill), and rank 0's rejection sampler keeps the
longest prefix the target agrees with plus one token of its own (``runtime/spec_decode.py``).

What each method needs is checked here, and what it needs of the target in
``check_speculative`` (called by ``EngineConfig``'s validator): a config that cannot run is
refused before any actor starts, with the field it is about.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field, StrictInt, model_validator

from ray_attn.model_config import ModelConfig, _Strict

# The most draft tokens a step verifies per request.  Past ~10 even a perfect proposer gains little
# (a step's cost grows with its query), and every draft position costs a logits row on rank 0.
MAX_SPECULATIVE_TOKENS = 16
# vLLM's defaults for prompt lookup when neither bound is given ("arbitrarily chosen", it says).
DEFAULT_PROMPT_LOOKUP = 5
# disable_by_batch_size="auto" on CPU: the largest batch at which n-gram speculation clearly paid in
# scripts/bench_spec_decode.py's sweep on SmolLM2-135M (README "Speculative decoding").  A CPU
# step's cost grows with its tokens almost from the first, so verifying k drafts per row soon costs
# more than the accepted ones save.  Since oneDNN's weights are packed (2026-12-05) batches 8 and 16
# still gain 3-7% (the JSON's ``break_even_batch`` says 16): within two runs' noise, so 4 stays.
CPU_DISABLE_BY_BATCH_SIZE = 4
# On a GPU a decode step is weight-bound up to large batches and a 1+k query costs little more
# (scripts/bench_spec_verify.py measures it on the H200): no limit until that sweep gives one.
GPU_DISABLE_BY_BATCH_SIZE = None
SUFFIX_FIELDS = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
                 "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")
# vLLM's, but 1,000 cached responses where vLLM keeps 10,000: its trees are C++, our index is
# Python dicts, ~190 bytes a cached token (1,000 responses of 300 tokens: ~57 MB on the driver)
SUFFIX_DEFAULTS = (24, 1000, 1.0, 0.1)


class SpeculativeConfig(_Strict):
    method: Literal["ngram", "draft_model", "suffix"] = Field("ngram", description=(
        "'ngram': prompt lookup -- the tokens that followed the latest earlier occurrence of the "
        "request's last n tokens (n from prompt_lookup_max down to prompt_lookup_min) in its own "
        "prompt and output. 'draft_model': a smaller model with the same vocabulary. 'suffix': "
        "suffix decoding -- continuations of the request's end in the responses the engine gave "
        "before and in its own tokens (spec/suffix.py)."))
    num_speculative_tokens: int = Field(..., description=(
        f"Draft tokens proposed per request and step (1..{MAX_SPECULATIVE_TOKENS}): a speculating "
        "request is verified as a query of 1 + k tokens."))
    prompt_lookup_min: Optional[int] = Field(None, description=(
        f"ngram: the shortest n-gram matched (default: prompt_lookup_max, or {DEFAULT_PROMPT_LOOKUP})."))
    prompt_lookup_max: Optional[int] = Field(None, description=(
        f"ngram: the longest n-gram matched (default: prompt_lookup_min, or {DEFAULT_PROMPT_LOOKUP})."))
    model: Optional[str] = Field(None, description=(
        "draft_model: the draft's checkpoint (an HF folder or a GGUF), with the target's vocabulary."))
    draft_model_config: Optional[ModelConfig] = Field(None, description=(
        "draft_model: the draft's shapes; with no `model`, random weights from its seed (tests). "
        "Read from `model` when that is given."))
    draft_tensor_parallel_size: Optional[int] = Field(None, description=(
        "draft_model: the draft runs on the target's ranks, so this must equal the target's "
        "tensor_parallel_size (vLLM's name; unset means that)."))
    suffix_decoding_max_tree_depth: Optional[int] = Field(None, description=(
        "suffix: the longest match looked for, in tokens (default 24, vLLM's)."))
    suffix_decoding_max_cached_requests: Optional[int] = Field(None, description=(
        "suffix: responses kept to draft from, oldest dropped first (default 1000 -- vLLM keeps "
        "10000 in C++ trees; here ~190 bytes a cached token on the driver; 0: only the request's "
        "own tokens)."))
    suffix_decoding_max_spec_factor: Optional[float] = Field(None, description=(
        "suffix: at most this many drafts per matched token (default 1.0, vLLM's)."))
    suffix_decoding_min_token_prob: Optional[float] = Field(None, description=(
        "suffix: a draft token needs at least this share of the matched occurrences (default 0.1, "
        "vLLM's)."))
    disable_by_batch_size: Union[StrictInt, Literal["auto"], None] = Field("auto", description=(
        "Speculate only in steps with at most this many running requests: a large batch is "
        "compute-bound, and verifying drafts there costs more than it saves. None: always. "
        f"'auto' (default): the measured break-even of the device -- on CPU "
        f"{CPU_DISABLE_BY_BATCH_SIZE} (scripts/bench_spec_decode.py), on a GPU none yet."))

    @model_validator(mode="after")
    def _check(self):
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens={k!r} is out of range: it must lie in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}]")
        limit = self.disable_by_batch_size
        if limit is not None and limit != "auto" and limit < 1:
            raise ValueError(f"disable_by_batch_size={self.disable_by_batch_size} must be >= 1 (or None)")
        suffix = [n for n in SUFFIX_FIELDS if getattr(self, n) is not None]
        if suffix and self.method != "suffix":
            raise ValueError(f"{suffix[0]} is for method='suffix'")
        if self.method == "suffix":
            for name in ("model", "draft_model_config", "draft_tensor_parallel_size", "prompt_lookup_min",
                         "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} is not for method='suffix'")
            p = self.suffix_params
            if p["max_depth"] < 1 or p["max_cached"] < 0 or p["spec_factor"] <= 0 or not 0 <= p["min_prob"] <= 1:
                raise ValueError("suffix_decoding_*: max_tree_depth >= 1, max_cached_requests >= 0, "
                                 f"max_spec_factor > 0 and min_token_prob in [0, 1], got {p}")
        elif self.method == "ngram":
            for name in ("model", "draft_model_config", "draft_tensor_parallel_size"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} is for method='draft_model'; method='ngram' has no draft model")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if v is not None and v < 1:
                    raise ValueError(f"{name}={v} must be >= 1")
            if lo is not None and hi is not None and lo > hi:
                raise ValueError(f"prompt_lookup_min={lo} is above prompt_lookup_max={hi}")
        else:
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} is for method='ngram'")
            if self.model is None and self.draft_model_config is None:
                raise ValueError("method='draft_model' needs the draft: model (a checkpoint) or "
                                 "draft_model_config (random weights)")
        return self

    @property
    def suffix_params(self) -> dict:
        """SuffixProposer's arguments, vLLM's defaults filled in."""
        v = [getattr(self, n) for n in SUFFIX_FIELDS]
        return dict(zip(("max_depth", "max_cached", "spec_factor", "min_prob"),
                        (d if x is None else x for x, d in zip(v, SUFFIX_DEFAULTS))))

    def batch_limit(self, device: str) -> Optional[int]:
        """``disable_by_batch_size`` with 'auto' resolved for ``device`` ('cpu', 'cuda:0', ...)."""
        if self.disable_by_batch_size != "auto":
            return self.disable_by_batch_size
        return CPU_DISABLE_BY_BATCH_SIZE if str(device).startswith("cpu") else GPU_DISABLE_BY_BATCH_SIZE

    @property
    def ngram_bounds(self) -> tuple[int, int]:
        """(min, max) n-gram lengths, vLLM's defaults filled in."""
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            return DEFAULT_PROMPT_LOOKUP, DEFAULT_PROMPT_LOOKUP
        return (lo if lo is not None else hi), (hi if hi is not None else lo)

    def draft_config(self) -> ModelConfig | None:
        """The draft model's config: its checkpoint's, overridden by ``draft_model_config``."""
        if self.method != "draft_model":
            return None
        if self.model is None:
            return self.draft_model_config
        from ray_attn.checkpoint import pretrained_fields

        try:
            fields = pretrained_fields(self.model)
        except OSError as e:
            raise ValueError(f"speculative_config.model={self.model!r}: {e}") from None
        over = {} if self.draft_model_config is None else self.draft_model_config.model_dump(exclude_unset=True)
        return ModelConfig(**(fields | over))


def check_speculative(spec: SpeculativeConfig, target: ModelConfig, tp: int) -> None:
    """What speculation needs of the engine it runs in; ``ValueError`` naming the field."""
    if spec.method != "draft_model":
        return
    draft = spec.draft_config()
    if spec.draft_tensor_parallel_size not in (None, tp):
        raise ValueError(f"speculative_config.draft_tensor_parallel_size={spec.draft_tensor_parallel_size} "
                         f"differs from tensor_parallel_size={tp}: the draft runs on the target's ranks")
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config: the draft's vocab_size={draft.vocab_size} differs from the "
                         f"target's vocab_size={target.vocab_size}: its tokens would not be the target's")
    if draft.num_attention_heads % tp:
        raise ValueError(f"speculative_config: tensor_parallel_size={tp} must divide the draft's "
                         f"num_attention_heads={draft.num_attention_heads}")
    kv = draft.num_key_value_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        raise ValueError(f"speculative_config: tensor_parallel_size={tp} and the draft's "
                         f"num_key_value_heads={kv} must divide one another")
    if draft.intermediate_size % tp:
        raise ValueError(f"speculative_config: tensor_parallel_size={tp} must divide the draft's "
                         f"intermediate_size={draft.intermediate_size}")
    if "chunked_attention" in draft.layer_kinds():
        raise ValueError("speculative_config: a draft with chunked (local) attention layers is not supported: "
                         "its catch-up queries carry no local-attention metadata; use a draft without them")
