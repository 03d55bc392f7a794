"""Validated configuration (pydantic): the model, its attention, the KV cache, the parallel layout.

Everything a kernel or a TP size cannot run is rejected here, on the driver, with a message that
says why -- before a placement group is reserved or an actor started.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from ray_attn.checkpoint import pretrained_fields
from ray_attn.lora.config import LoRAConfig
# The model's config and its constants live in ray_attn.model_config; re-exported here, where
# users have always imported them from.
from ray_attn.model_config import (  # noqa: F401
    ARCHITECTURES, CHECKPOINT_SHAPE_FIELDS, FAMILY_FIXED, LLAMA4_FIELDS, MOE_ARCHITECTURES, MOE_FIELDS,
    ROPE_TYPES, SUPPORTED_HEAD_SIZES, Architecture, LayerType, ModelConfig, _Strict)
from ray_attn.presets import MODEL_PRESETS  # named model shapes; re-exported here  # noqa: F401
from ray_attn.spec_config import SpeculativeConfig, check_speculative


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
    batch_invariant: bool = Field(False, description=(
        "Kernels whose per-row results do not depend on the rest of the step (vLLM's "
        "VLLM_BATCH_INVARIANT): fixed-tile GEMMs and one FlashAttention 3 KV split, so that "
        "speculative greedy gives plain greedy's tokens on GPUs in bf16 (ray_attn/backend/batch_invariant.py). "
        "Cascade attention in it runs on a fixed grid (batch_invariant_cascade_grid). Slower; dense "
        "unquantized models without LoRA, on FA3 or the torch kernel."))
    batch_invariant_cascade_grid: int = Field(1024, ge=0, description=(
        "In batch_invariant mode, cascade attention splits a token's keys at the last multiple of this "
        "many tokens before it, and prefill chunks and drafts stop at those lines "
        "(ray_attn/planner/invariant.py); a multiple of cache.block_size. 0: no cascade in the mode."))


class EngineConfig(_Strict):
    model: ModelConfig = Field(default_factory=ModelConfig, description="The decoder to serve.")
    cache: CacheConfig = Field(default_factory=CacheConfig, description="Paged KV cache.")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description="Ranks and kernels.")
    checkpoint: Optional[str] = Field(None, description=(
        "Folder with an HF-format checkpoint (config.json and safetensors), a .gguf file or a folder "
        "holding one; random weights from model.seed when unset. With a checkpoint, model defaults to "
        "its config (config.json or the GGUF's metadata), and a model "
        "given as a mapping overrides fields of it (e.g. {dtype: bfloat16}); a model whose shapes "
        "differ from it is refused."))
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
        "runs on the host, so there is nothing to overlap). With speculative_config, steps that "
        "may speculate (batches up to disable_by_batch_size) are not deferred: the next plan needs "
        "their accepted lengths."))
    num_sms: Optional[int] = Field(None, gt=0, description="SM count for the cascade heuristic; taken from the workers' GPU when unset.")
    speculative_config: Optional[SpeculativeConfig] = Field(None, description=(
        "Speculative decoding (vLLM's SpeculativeConfig): proposed tokens verified as multi-token "
        "decode queries (ray_attn/spec_config.py). None: off."))
    lora_config: Optional[LoRAConfig] = Field(None, description=(
        "Multi-LoRA (vLLM's LoRAConfig): PEFT adapters named per request (LoRARequest), mixed with "
        "the base model in one batch (ray_attn/lora/). None: off."))

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
        if isinstance(self.model.quantization, str):  # imported lazily, as ModelConfig does: ray_attn.model loads torch
            from ray_attn import gguf_file
            from ray_attn.model.quantization import GGUF

            if self.model.quantization == GGUF and (self.checkpoint is None
                                                    or gguf_file.gguf_path(self.checkpoint) is None):
                raise ValueError(f"model.quantization='gguf' runs a GGUF checkpoint's 4-bit blocks as stored, "
                                 f"but checkpoint={self.checkpoint!r} is not a GGUF file or a folder of one")
        if self.parallel.batch_invariant:
            check_batch_invariant(self.model, self.parallel, self.lora_config is not None, self.cache.block_size)
        check_runnable(self.model, self.cache, self.parallel)
        if self.lora_config is not None and (self.model.architecture in MOE_ARCHITECTURES
                                             or self.model.architecture == "MptForCausalLM"):
            raise ValueError(f"lora_config: {self.model.architecture} is not served with LoRA adapters (dense "
                             "families whose checkpoints name q/k/v/o_proj and gate/up/down_proj)")
        if self.speculative_config is not None:
            check_speculative(self.speculative_config, self.model, self.parallel.tensor_parallel_size)
        return self


def check_batch_invariant(model: ModelConfig, parallel: ParallelConfig, lora: bool, block_size: int) -> None:
    """What ``parallel.batch_invariant`` does not make invariant is refused by name."""
    grid = parallel.batch_invariant_cascade_grid
    if grid % block_size:
        raise ValueError(f"parallel.batch_invariant_cascade_grid={grid} is not a multiple of "
                         f"cache.block_size={block_size}")
    why = ("quantized weights (model.quantization)" if model.quantization else
           "MoE experts" if model.moe_layer_ids else "LoRA adapters (lora_config)" if lora else
           "FlashAttention 2 (kernel='fa2': its KV splits are its own)" if parallel.kernel == "fa2" else None)
    if why:
        raise ValueError(f"parallel.batch_invariant: {why} have no batch-invariant kernels here; "
                         "it covers dense bf16/fp16/float32 models on FA3 or the torch kernel")


def _checkpoint_fields(folder: str) -> dict:
    try:
        return pretrained_fields(folder)
    except OSError as e:  # as a ValueError, so that pydantic reports it on the field
        raise ValueError(f"checkpoint={folder!r}: {e}") from None


def _holds_gguf(folder: str) -> bool:
    import os

    return os.path.isdir(folder) and not os.path.isfile(os.path.join(folder, "config.json")) and any(
        f.endswith(".gguf") for f in os.listdir(folder))


def check_matches_checkpoint(model: ModelConfig, folder: str) -> None:
    """Refuse, naming every field and both values, a model whose shapes differ from those of the
    checkpoint's config.json: its weights could not load (or would compute another family)."""
    own = ModelConfig(**_checkpoint_fields(folder))
    # where the checkpoint's own config comes from: its config.json, or a GGUF's metadata
    src = "GGUF metadata" if str(folder).endswith(".gguf") or _holds_gguf(folder) else "config.json"
    diff = [f"{name}={getattr(model, name)!r} ({src}: {getattr(own, name)!r})"
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
        from ray_attn.model.parallel_linear import check_fp8_tp_slices  # block-wise FP8: TP slices on 128-blocks

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
