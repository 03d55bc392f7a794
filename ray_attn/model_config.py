"""The model's configuration (pydantic): which family, its shapes and attention options, and
everything a family's checkpoints fix -- validated on the driver, before any actor starts.

``ModelConfig`` field names follow Hugging Face's ``LlamaConfig``; ``from_pretrained`` reads a
checkpoint's own config through ``ray_attn.checkpoint``.  ``ray_attn.config`` re-exports all of it
beside the engine's other configs.
"""

from __future__ import annotations

from typing import Callable, Literal, Optional, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ray_attn.presets import MODEL_PRESETS

LayerType = Literal["full_attention", "sliding_attention", "chunked_attention"]
SUPPORTED_HEAD_SIZES = (32, 64, 96, 128, 160, 192, 224, 256)
# HF ``architectures`` names with a model family in ray_attn.model (see its registry).
Architecture = Literal["LlamaForCausalLM", "MistralForCausalLM", "MptForCausalLM", "Gemma2ForCausalLM",
                       "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM",
                       "Llama4ForCausalLM"]
ARCHITECTURES: tuple[str, ...] = get_args(Architecture)
# rope_scaling types ray_attn.model.layers.rope_inv_freq computes.
ROPE_TYPES = ("default", "llama3")
# The ModelConfig properties a checkpoint's tensors fix: a model that differs from its checkpoint's
# config.json in any of them cannot load it (or, for the family, computes another function).
CHECKPOINT_SHAPE_FIELDS = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads", "num_key_value_heads", "head_size", "tie_word_embeddings",
                           "num_local_experts", "expert_intermediate_size", "shared_expert_intermediate_size",
                           "moe_layer_ids")
# The families with routed experts (ray_attn/model/moe.py), and the fields only they read.
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "Llama4ForCausalLM")
MOE_FIELDS = ("num_local_experts", "moe_intermediate_size", "shared_expert_intermediate_size", "moe_layers",
              "norm_topk_prob")
# Llama 4's attention options: no other family's layers read them, so elsewhere they are refused.
LLAMA4_FIELDS = ("no_rope_layers", "use_qk_norm", "attn_temperature_tuning")

# Fields a family's checkpoints fix, as (value given the other fields, why).  Unset, the field
# takes that value; set to anything else, the config is refused: no checkpoint of the family
# could hold it.
FAMILY_FIXED: dict[str, dict[str, tuple[Callable[[dict], object], str]]] = {
    "MptForCausalLM": {
        "use_alibi": (lambda f: True, "MPT's only position signal is ALiBi"),
        "num_key_value_heads": (lambda f: f["num_attention_heads"],
                                "MPT checkpoints have one KV head per query head"),
        "intermediate_size": (lambda f: 4 * f["hidden_size"],
                              "HF transformers' MPT MLP is 4 * d_model wide, whatever expansion_ratio says"),
    },
    "Gemma2ForCausalLM": {"use_alibi": (lambda f: False, "Gemma-2 uses RoPE")},
    "Qwen2ForCausalLM": {"use_alibi": (lambda f: False, "Qwen2 uses RoPE")},
    "Qwen3ForCausalLM": {"use_alibi": (lambda f: False, "Qwen3 uses RoPE")},
    "Qwen3MoeForCausalLM": {"use_alibi": (lambda f: False, "Qwen3-MoE uses RoPE"),
                            "shared_expert_intermediate_size": (lambda f: None, "Qwen3-MoE has no shared expert")},
    "MixtralForCausalLM": {
        "use_alibi": (lambda f: False, "Mixtral uses RoPE"),
        "norm_topk_prob": (lambda f: True, "Mixtral renormalises its top-k routing weights"),
        "moe_layers": (lambda f: None, "every Mixtral layer is sparse"),
        "moe_intermediate_size": (lambda f: None, "Mixtral's experts are intermediate_size wide"),
        "shared_expert_intermediate_size": (lambda f: None, "Mixtral has no shared expert")},
    "Llama4ForCausalLM": {
        "use_alibi": (lambda f: False, "Llama 4 uses RoPE (and NoPE layers)"),
        "norm_topk_prob": (lambda f: False, "Llama 4's sigmoid routing weights are not renormalised"),
        "shared_expert_intermediate_size": (lambda f: f["moe_intermediate_size"] or f["intermediate_size"],
                                            "Llama 4's shared expert is as wide as its routed experts")},
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Strict):
    """A decoder of one of the supported families; field names follow Hugging Face's
    ``LlamaConfig`` (``from_pretrained`` maps the other families' names onto them)."""

    architecture: Architecture = Field("LlamaForCausalLM", description=(
        "HF architectures name, which picks the model family: Llama/Mistral, MPT (ALiBi, LayerNorm, "
        "GELU MLP), Gemma-2 (soft caps, GeGLU, 1 + weight RMSNorms), Qwen2 (q/k/v biases) or Qwen3 "
        "(per-head q/k RMSNorm)."))
    vocab_size: int = Field(512, gt=0, description="Vocabulary size.")
    hidden_size: int = Field(256, gt=0, description="Model width.")
    intermediate_size: int = Field(512, gt=0, description="MLP inner width (MPT: 4 * d_model).")
    num_hidden_layers: int = Field(4, gt=0, description="Decoder layers.")
    num_attention_heads: int = Field(4, gt=0, description="Query heads.")
    num_key_value_heads: int = Field(2, gt=0, description="KV heads (GQA when fewer than query heads).")
    head_dim: Optional[int] = Field(None, description="Per-head size; hidden_size / heads when unset.")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base frequency.")
    rope_scaling: Optional[dict] = Field(None, description="HF rope_scaling dict (rope_type 'default' or 'llama3'), as in Llama 3.1 checkpoints.")
    rms_norm_eps: float = Field(1e-5, gt=0, description="Norm epsilon (MPT's layer_norm_epsilon, for its LayerNorms).")
    max_position_embeddings: int = Field(8192, gt=0, description="Longest sequence the model accepts.")
    tie_word_embeddings: bool = Field(False, description="Share the embedding and LM-head weights.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weight and activation dtype.")
    sliding_window: Optional[int] = Field(None, gt=0, description="Window in tokens for sliding_attention layers.")
    attention_chunk_size: Optional[int] = Field(None, gt=0, description="Chunk in tokens for chunked_attention (Llama 4 iRoPE) layers.")
    layer_types: Optional[list[LayerType]] = Field(None, description="Attention kind per layer; all full_attention when unset.")
    logits_soft_cap: Optional[float] = Field(None, gt=0, description="Attention logits soft cap (Gemma-2's attn_logit_softcapping).")
    final_logit_soft_cap: Optional[float] = Field(None, gt=0, description="Output logits become cap * tanh(logits / cap) (Gemma-2's final_logit_softcapping).")
    query_pre_attn_scalar: Optional[float] = Field(None, gt=0, description="Attention scale is query_pre_attn_scalar ** -0.5 (Gemma-2); head size when unset.")
    softmax_scale: Optional[float] = Field(None, gt=0, description="The attention scale itself (MPT's attn_config.softmax_scale); head_size ** -0.5 when unset.")
    clip_qkv: Optional[float] = Field(None, gt=0, description="Clamp q, k and v to [-clip_qkv, clip_qkv] after the projection (MPT's attn_config.clip_qkv).")
    use_alibi: bool = Field(False, description="ALiBi position bias instead of RoPE.")
    alibi_bias_max: float = Field(8.0, gt=0, description=(
        "ALiBi slope of head i (1-based) of n, n rounded up to a power of 2: 2 ** (-alibi_bias_max * i / n) "
        "(MPT's attn_config.alibi_bias_max; 8 gives the ALiBi paper's slopes)."))
    # -- mixture of experts (Mixtral, Qwen3-MoE, Llama 4) --
    num_local_experts: Optional[int] = Field(None, gt=0, description=(
        "Routed experts per MoE layer (HF num_local_experts; Qwen3-MoE's num_experts). Unset: a dense model."))
    num_experts_per_tok: int = Field(2, gt=0, description="Experts each token is routed to (top-k).")
    moe_intermediate_size: Optional[int] = Field(None, gt=0, description=(
        "Each expert's inner width; intermediate_size when unset (intermediate_size stays the width of "
        "the dense MLP layers: Qwen3-MoE's mlp_only_layers, Llama 4's intermediate_size_mlp)."))
    shared_expert_intermediate_size: Optional[int] = Field(None, gt=0, description=(
        "Inner width of the shared expert every token also goes through (Llama 4); none when unset."))
    norm_topk_prob: bool = Field(False, description=(
        "Renormalise the top-k softmax routing weights to sum to 1 (Qwen3-MoE's norm_topk_prob; Mixtral always)."))
    moe_layers: Optional[list[int]] = Field(None, description=(
        "Indices of the sparse (MoE) layers, the others dense; every layer when unset. From HF's "
        "moe_layers / interleave_moe_layer_step (Llama 4) or decoder_sparse_step / mlp_only_layers (Qwen3-MoE)."))
    # -- Llama 4 attention --
    no_rope_layers: Optional[list[int]] = Field(None, description=(
        "Llama 4's per-layer RoPE switch, HF's (inverted) name and meaning: 1 = RoPE, 0 = NoPE. Unset: RoPE everywhere."))
    use_qk_norm: bool = Field(False, description="Llama 4: L2-normalise q and k (no weight) after RoPE, on RoPE layers.")
    attn_temperature_tuning: bool = Field(False, description=(
        "Llama 4: on NoPE layers scale q by 1 + attn_scale * log1p(floor((pos + 1) / floor_scale))."))
    floor_scale: float = Field(8192.0, gt=0, description="Llama 4 temperature tuning: positions per step.")
    attn_scale: float = Field(0.1, description="Llama 4 temperature tuning: strength.")
    quantization: Optional[Union[str, dict]] = Field(None, description=(
        "FP8 (e4m3) weights for the linear layers of attention and the dense MLP; the embedding, LM head "
        "and norms stay in dtype. 'fp8': quantize a full-precision checkpoint (or the random weights) "
        "when it loads, per output channel, with dynamic per-token activation scales (vLLM's "
        "--quantization fp8). A mapping is a quantized checkpoint's quantization_config, read from its "
        "config.json: compressed-tensors FP8 (per-channel weight_scale with dynamic per-token activations, "
        "or per-tensor weight_scale with a static input_scale) or block-wise fp8 (weight_block_size "
        "[128, 128], weight_scale_inv). 'gguf': a GGUF checkpoint's Q4_0 / Q4_1 weights run as stored, "
        "packed for torch's int4 matmul in bfloat16, on CPU ranks (ray_attn/model/gguf_q4.py; vLLM's "
        "quantization='gguf'). Other formats are refused by name. Unset: unquantized weights (a GGUF "
        "dequantized to dtype). "
        "Independent of CacheConfig.kv_cache_dtype."))
    seed: int = Field(0, description="Seed for random weights when no checkpoint is given.")
    eos_token_ids: list[int] = Field(default_factory=list, description=(
        "Token ids that end generation (finish_reason 'stop') unless a request sets ignore_eos; "
        "from the checkpoint's generation_config.json / config.json eos_token_id. Empty: none."))

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def attention_scale(self) -> float:
        if self.softmax_scale is not None:
            return self.softmax_scale
        return (self.query_pre_attn_scalar or self.head_size) ** -0.5

    @property
    def expert_intermediate_size(self) -> int | None:
        if self.num_local_experts is None:
            return None
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        """The sparse layers' indices (none for a dense model)."""
        if self.num_local_experts is None:
            return ()
        return tuple(range(self.num_hidden_layers) if self.moe_layers is None else self.moe_layers)

    def uses_rope(self, layer: int) -> bool:
        return not self.use_alibi and (self.no_rope_layers is None or bool(self.no_rope_layers[layer]))

    @classmethod
    def from_name(cls, name: str, **overrides) -> "ModelConfig":
        """A named shape from ``MODEL_PRESETS``, with ``overrides`` on top."""
        if name not in MODEL_PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(MODEL_PRESETS)}")
        return cls(**(MODEL_PRESETS[name] | overrides))

    @classmethod
    def from_pretrained(cls, folder: str, **overrides) -> "ModelConfig":
        """The config of an HF-format checkpoint folder (its ``config.json``), so that a model
        loaded with ``EngineConfig(checkpoint=folder)`` gets the checkpoint's own family, shapes,
        RoPE base and scaling, norm epsilon, windows, caps and end-of-sequence ids
        (``ray_attn.hf_config`` maps each family's names).  ``overrides`` win (e.g. ``dtype``)."""
        from ray_attn.checkpoint import pretrained_fields

        return cls(**(pretrained_fields(folder) | overrides))

    @model_validator(mode="before")
    @classmethod
    def _family_defaults(cls, data):
        if not isinstance(data, dict):
            return data
        fixed = FAMILY_FIXED.get(data.get("architecture", cls.model_fields["architecture"].default), {})
        given = {name: f.default for name, f in cls.model_fields.items()} | data
        return data | {name: value(given) for name, (value, _) in fixed.items() if name not in data}

    def layer_kinds(self) -> list[str]:
        return list(self.layer_types or ["full_attention"] * self.num_hidden_layers)

    @model_validator(mode="after")
    def _check(self):
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if kind not in ROPE_TYPES:
                raise ValueError(f"rope_scaling rope_type={kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
        h, kv = self.num_attention_heads, self.num_key_value_heads
        if h % kv:
            raise ValueError(f"num_attention_heads={h} must be a multiple of num_key_value_heads={kv}")
        if self.head_size not in SUPPORTED_HEAD_SIZES:
            raise ValueError(f"head size {self.head_size} is not supported; choose one of {SUPPORTED_HEAD_SIZES}")
        if self.head_dim is None and self.hidden_size % h:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={h}; set head_dim")
        kinds = self.layer_kinds()
        if len(kinds) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(kinds)} entries for num_hidden_layers={self.num_hidden_layers}")
        if "sliding_attention" in kinds and self.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        if "chunked_attention" in kinds and self.attention_chunk_size is None:
            raise ValueError("layer_types has chunked_attention layers but attention_chunk_size is not set")
        if self.softmax_scale is not None and self.query_pre_attn_scalar is not None:
            raise ValueError(f"softmax_scale={self.softmax_scale} and query_pre_attn_scalar="
                             f"{self.query_pre_attn_scalar} both set the attention scale; set one")
        self._check_moe_and_llama4()
        if self.quantization is not None:
            # Lazily: only a quantized config pays for the model package (and torch).
            from ray_attn.model.quantization import check_model, parse_quantization

            check_model(parse_quantization(self.quantization), self.architecture,
                        self.num_local_experts is not None or self.architecture in MOE_ARCHITECTURES)
        values = dict(self)
        for name, (value, why) in FAMILY_FIXED.get(self.architecture, {}).items():
            if values[name] != value(values):
                raise ValueError(f"architecture={self.architecture} needs {name}={value(values)!r}, "
                                 f"got {values[name]!r} ({why})")
        return self


    def _check_moe_and_llama4(self) -> None:
        fields, arch, n = type(self).model_fields, self.architecture, self.num_hidden_layers
        if arch not in MOE_ARCHITECTURES:
            for name in MOE_FIELDS:
                if getattr(self, name) != fields[name].default:
                    raise ValueError(f"{name}={getattr(self, name)!r}: architecture={arch} has no experts "
                                     f"(MoE families: {', '.join(MOE_ARCHITECTURES)})")
        elif self.num_local_experts is None:
            raise ValueError(f"architecture={arch} needs num_local_experts (its routed experts per MoE layer)")
        if arch != "Llama4ForCausalLM":
            for name in LLAMA4_FIELDS:
                if getattr(self, name) != fields[name].default:
                    raise ValueError(f"{name}={getattr(self, name)!r} is a Llama 4 option; "
                                     f"architecture={arch} does not read it")
        E, k = self.num_local_experts, self.num_experts_per_tok
        if E is not None and k > E:
            raise ValueError(f"num_experts_per_tok={k} must not exceed num_local_experts={E}")
        if self.moe_layers is not None:
            ids = self.moe_layers
            if sorted(set(ids)) != list(ids) or any(not 0 <= i < n for i in ids):
                raise ValueError(f"moe_layers={ids} must be increasing layer indices in [0, num_hidden_layers={n})")
        if self.no_rope_layers is not None:
            r = self.no_rope_layers
            if len(r) < n or any(v not in (0, 1) for v in r):
                raise ValueError(f"no_rope_layers={r} needs a 0 (NoPE) or 1 (RoPE) for each of the {n} layers")
