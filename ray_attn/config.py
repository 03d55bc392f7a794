"""Validated configuration (pydantic): the model, its attention, the KV cache, the parallel layout.

Everything a kernel or a TP size cannot run is rejected here, on the driver, with a message that
says why -- before a placement group is reserved or an actor started.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Literal, Optional, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ray_attn import hf_config
from ray_attn.presets import MODEL_PRESETS  # named model shapes; re-exported here  # noqa: F401

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
        "[128, 128], weight_scale_inv). Other formats are refused by name. Unset: unquantized weights. "
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


def _read_json(path: str) -> dict:
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def pretrained_fields(folder: str) -> dict:
    """``ModelConfig`` fields of an HF-format checkpoint folder: its config.json's, with the end-of-
    sequence ids of its generation_config.json where that file sets ``eos_token_id`` (what
    transformers' ``generate`` stops on), else config.json's."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"checkpoint folder {folder!r} does not exist (or is not a directory)")
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint folder {folder!r} has no config.json; an HF-format checkpoint "
                                "holds config.json next to its *.safetensors")
    fields = hf_config.fields_from_hf(_read_json(path), folder)
    gen_path = os.path.join(folder, "generation_config.json")
    if os.path.isfile(gen_path):
        gen = _read_json(gen_path)
        if "eos_token_id" in gen:
            fields["eos_token_ids"] = hf_config.eos_token_ids(gen["eos_token_id"], gen_path)
    return fields


class CacheConfig(_Strict):
    block_size: int = Field(16, gt=0, description="Tokens per KV block; a multiple of 16 (256 for flash-attn 2).")
    num_blocks: Optional[int] = Field(None, gt=0, description="Blocks per rank; sized from memory_fraction when unset.")
    memory_fraction: float = Field(0.85, gt=0, le=1, description=(
        "When num_blocks is unset. On GPUs, vLLM's gpu_memory_utilization: the share of the device's total "
        "memory this engine may use -- weights, the largest step's activations (measured by a profile "
        "step), CUDA graphs and the KV cache, which gets the rest. On CPU: the share of the host's "
        "available memory for the KV cache, split over the ranks and capped at 1 GiB."))
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = Field("auto", description="'auto' stores K/V in the model dtype; fp8 stores float8 e4m3 with per-layer scales.")
    enable_prefix_caching: bool = Field(True, description="Reuse full KV blocks of identical prefixes across requests.")
    calculate_kv_scales: bool = Field(False, description=(
        "With an fp8 KV cache: set each layer's q/k/v scales from the first batch it sees "
        "(absolute maximum over 200 for q and k, 100 for v, as vLLM's calculate_kv_scales), "
        "instead of 1.0. The scales are per rank and fixed after that batch."))
    host_cache_gib: float = Field(0.0, ge=0, description=(
        "Host-memory tier per rank (GiB, pinned on GPUs): a cached block evicted from the device cache "
        "is copied there, and a later prefix hit on it is copied back instead of recomputed. 0: off."))
    kv_sharing: bool = Field(False, description=(
        "Publish each full block computed to the KV store of the rank's node, and fetch prefixes "
        "another replica with the same model and TP layout computed (on any node) instead of "
        "recomputing them, when fetching pays (kv_share_min_tokens, kv_share_max_tokens)."))
    kv_store_gib: float = Field(4.0, gt=0, description="Capacity of each node's shared KV store (GiB); full, it drops "
                                "its least recently used blocks.")
    kv_share_min_tokens: int = Field(64, ge=0, description=(
        "Fewest prefix tokens a shared-store fetch must cover to be taken (else they are recomputed): "
        "the break-even of a fetch's fixed cost against prefill, scripts/bench_kv_tiers.py."))
    kv_share_max_tokens: Optional[int] = Field(None, ge=1, description=(
        "Most prefix tokens a shared-store fetch may cover (a longer run is recomputed). Where a prefill "
        "costs nearly the same for 16 tokens as for 1,000 (a GPU) and a fetch grows with its bytes, "
        "fetching wins only for short runs: on one H200 with an 8B model, 16-128 tokens "
        "(scripts/bench_kv_tiers.py --part breakeven reports the window). None: no limit."))

    @model_validator(mode="after")
    def _check(self):
        if self.kv_share_max_tokens is not None and self.kv_share_max_tokens < self.kv_share_min_tokens:
            raise ValueError(f"kv_share_max_tokens={self.kv_share_max_tokens} is below kv_share_min_tokens="
                             f"{self.kv_share_min_tokens}: no fetch could be taken")
        if self.kv_sharing and not self.enable_prefix_caching:
            raise ValueError("kv_sharing needs enable_prefix_caching (blocks are found by their prefix hashes)")
        if self.host_cache_gib and not self.enable_prefix_caching:
            raise ValueError("host_cache_gib needs enable_prefix_caching (blocks are found by their prefix hashes)")
        if self.block_size % 16:
            raise ValueError(f"block_size must be a multiple of 16, got {self.block_size}")
        return self


class ParallelConfig(_Strict):
    tensor_parallel_size: int = Field(1, gt=0, description="Ranks that split the heads of one model replica.")
    kernel: Literal["auto", "fa3", "fa2", "torch"] = Field("auto", description="Attention kernel; 'auto' picks the fastest the device supports.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where workers run; 'auto' uses GPUs when the cluster has them.")
    num_cpus_per_worker: float = Field(1.0, gt=0, description="CPUs reserved per rank's bundle.")
    use_compiled_graph: bool = Field(False, description="Drive steady-state steps through a Ray compiled graph.")
    cuda_graphs: Literal["auto", "on", "off"] = Field("auto", description="Replay pure-decode steps from captured CUDA graphs (GPU workers with a flash kernel), at any tensor_parallel_size; 'auto' runs eagerly if a capture fails, 'on' raises, 'off' never captures.")
    cuda_graph_max_batch: int = Field(256, gt=0, description="Largest decode batch that replays a CUDA graph (capped at max_num_seqs); larger steps run eagerly.")
    ray_address: Optional[str] = Field(None, description="Ray cluster to join; None starts or joins via RAY_ADDRESS.")


class EngineConfig(_Strict):
    model: ModelConfig = Field(default_factory=ModelConfig, description="The decoder to serve.")
    cache: CacheConfig = Field(default_factory=CacheConfig, description="Paged KV cache.")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description="Ranks and kernels.")
    checkpoint: Optional[str] = Field(None, description=(
        "Folder with an HF-format checkpoint (config.json and safetensors); random weights from "
        "model.seed when unset. With a checkpoint, model defaults to its config.json, and a model "
        "given as a mapping overrides fields of it (e.g. {dtype: bfloat16}); a model whose shapes "
        "differ from config.json is refused."))
    max_num_seqs: int = Field(64, gt=0, description="Most requests in one step.")
    max_num_batched_tokens: int = Field(2048, gt=0, description="Most tokens in one step (chunked prefill splits longer prompts).")
    enable_cascade: bool = Field(True, description="Let the planner choose cascade attention for shared prefixes.")
    cascade_min_saved_kv_tokens: Optional[int] = Field(None, ge=0, description=(
        "KV tokens per layer a cascade step must save to be chosen. Unset: the break-even measured "
        "for the GPU kernels (vLLM's cost model on the torch kernel). 0 cascades whenever it is "
        "legal (tests and the accuracy gate force it this way)."))
    async_scheduling: Optional[bool] = Field(None, description=(
        "Plan and submit step N+1 before step N's tokens are back: the ranks fill those inputs "
        "on the device, and the host's planning, messaging and staging overlap the GPU's work. "
        "Outputs then arrive one step later, and a request that hits a stop token computes one "
        "token more than it returns. Unset: on when the ranks run on GPUs (on CPU the forward "
        "runs on the host, so there is nothing to overlap)."))
    num_sms: Optional[int] = Field(None, gt=0, description="SM count for the cascade heuristic; taken from the workers' GPU when unset.")

    @model_validator(mode="before")
    @classmethod
    def _model_from_checkpoint(cls, data):
        """The checkpoint's own config as the model, a mapping ``model`` as overrides on top of it."""
        if not isinstance(data, dict) or not isinstance(data.get("checkpoint"), str):
            return data
        model = data.get("model")
        if model is not None and not isinstance(model, dict):
            return data  # a ModelConfig: compared with config.json once validated
        fields = _checkpoint_fields(data["checkpoint"])
        own = fields.get("quantization")
        if (model or {}).get("quantization") == "fp8" and isinstance(own, dict) and own.get("quant_method") == "fp8":
            model = {k: v for k, v in model.items() if k != "quantization"}  # vLLM's --quantization fp8 on an fp8 checkpoint
        return data | {"model": fields | (model or {})}

    @model_validator(mode="after")
    def _check(self):
        if self.checkpoint is not None:
            check_matches_checkpoint(self.model, self.checkpoint)
        elif isinstance(self.model.quantization, dict):
            raise ValueError(f"model.quantization (quant_method={self.model.quantization.get('quant_method')!r}) "
                             "describes a quantized checkpoint's tensors, and no checkpoint is given; random "
                             "weights take quantization='fp8'")
        check_runnable(self.model, self.cache, self.parallel)
        return self


def _checkpoint_fields(folder: str) -> dict:
    try:
        return pretrained_fields(folder)
    except OSError as e:  # as a ValueError, so that pydantic reports it on the field
        raise ValueError(f"checkpoint={folder!r}: {e}") from None


def check_matches_checkpoint(model: ModelConfig, folder: str) -> None:
    """Refuse, naming every field and both values, a model whose shapes differ from those of the
    checkpoint's config.json: its weights could not load (or would compute another family)."""
    own = ModelConfig(**_checkpoint_fields(folder))
    diff = [f"{name}={getattr(model, name)!r} (config.json: {getattr(own, name)!r})"
            for name in CHECKPOINT_SHAPE_FIELDS if getattr(model, name) != getattr(own, name)]
    if diff:
        raise ValueError(f"model disagrees with checkpoint {folder!r}: {', '.join(diff)}; leave model unset "
                         "(or give only overrides such as dtype) to take the checkpoint's own config")
    # A quantized checkpoint runs its own scheme; an unquantized one runs unquantized or 'fp8'.
    if own.quantization is not None and model.quantization != own.quantization:
        raise ValueError(f"model.quantization={model.quantization!r} differs from checkpoint {folder!r}'s "
                         f"quantization_config (quant_method={own.quantization.get('quant_method')!r}): its "
                         "stored tensors run only their own scheme; leave quantization unset")
    if own.quantization is None and isinstance(model.quantization, dict):
        raise ValueError(f"model.quantization (quant_method={model.quantization.get('quant_method')!r}) describes "
                         f"a quantized checkpoint, but {folder!r}'s config.json has no quantization_config; "
                         "use quantization='fp8' to quantize it when it loads")


def check_runnable(model: ModelConfig, cache: CacheConfig, parallel: ParallelConfig) -> None:
    """Reject, with the reason, a layout no worker could run."""
    tp = parallel.tensor_parallel_size
    if model.num_attention_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide num_attention_heads={model.num_attention_heads}")
    kv = model.num_key_value_heads
    if kv >= tp and kv % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide num_key_value_heads={kv} (or exceed it, to replicate)")
    if kv < tp and tp % kv:
        raise ValueError(f"num_key_value_heads={kv} must divide tensor_parallel_size={tp} to replicate KV heads")
    widths = {"moe_intermediate_size (each expert's width)": model.expert_intermediate_size,
              "shared_expert_intermediate_size": model.shared_expert_intermediate_size}
    if len(model.moe_layer_ids) < model.num_hidden_layers:  # some layers are dense
        widths = {"intermediate_size": model.intermediate_size} | widths
    for name, width in widths.items():
        if width is not None and width % tp:  # each rank holds a slice of every MLP's / expert's width
            raise ValueError(f"tensor_parallel_size={tp} must divide {name}={width}")
    if isinstance(model.quantization, dict) and model.quantization.get("quant_method") == "fp8":
        from ray_attn.model.layers import check_fp8_tp_slices  # block-wise FP8: TP slices on 128-blocks

        check_fp8_tp_slices(model, tp)
    if model.attention_chunk_size and model.attention_chunk_size % cache.block_size:
        raise ValueError(f"attention_chunk_size={model.attention_chunk_size} must be a multiple of "
                         f"block_size={cache.block_size}")
    if parallel.kernel != "auto":
        import torch

        from ray_attn.backend.kernels import LayerKernelSpec, unsupported_reason

        spec = LayerKernelSpec(model.head_size, getattr(torch, model.dtype), cache.kv_cache_dtype,
                               cache.block_size, model.use_alibi)
        reason = unsupported_reason(parallel.kernel, spec)
        if reason:
            raise ValueError(f"kernel={parallel.kernel!r} cannot run this model: {reason}")
