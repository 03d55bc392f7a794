"""What every decoder family shares: the constructor the worker calls, weights by checkpoint name,
the paged KV cache, the step's forward and the logits.

A family (``llama.py``, ``mpt.py``, ``gemma2.py``, ``qwen2.py``, ``qwen3.py``) names its decoder
layer and norm classes and its checkpoint tensor names; everything the worker and
``cuda_graphs.py`` touch lives here, so every family serves through the same calls.

Layout per rank: query heads and the MLP's inner width are split, KV heads split or replicated
(see ``qkv_parallel``); embedding, norms and LM head are replicated, so ``compute_logits``
returns the full vocabulary on every rank without a gather.  Two all-reduces per layer
(o_proj, down_proj).  The per-step work that does not depend on the layer -- RoPE cos/sin, the
attention output buffer -- is done once per forward and shared by every layer.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ray_attn.backend.cache import FP8_DTYPE, is_fp8_kv_cache
from ray_attn.backend.flash_attn import FlashAttentionBackend
from ray_attn.config import ModelConfig
from ray_attn.metadata import FlashAttentionMetadata
from ray_attn.model import gguf_weights, weights
from ray_attn.model.attention import ParallelAttention
from ray_attn.model.fused import add_rms_norm
from ray_attn.model.gemv import linear
from ray_attn.model.layers import RMSNorm, RotaryEmbedding, Shard, new_param, replicated
from ray_attn.model.parallel_linear import Fp8Linear
from ray_attn.model.quantization import GGUF, check_model, parse_quantization
from ray_attn.model.tp import TPGroup


class CausalLM(nn.Module):
    # Set by each family.
    architectures: ClassVar[tuple[str, ...]]  # the HF ``architectures`` names it serves
    layer_class: ClassVar[type[nn.Module]]  # (config, layer_idx, tp, **kw); has ``self_attn``
    norm_class: ClassVar[type[RMSNorm]]  # the final norm's class
    embed_name: ClassVar[str]  # checkpoint names of the embedding and the final norm
    final_norm_name: ClassVar[str]
    # Checkpoint layouts ``layer_shards`` can name (the first is what we write), and prefixes a
    # checkpoint may put before every name (a multimodal checkpoint's text part), with the
    # prefixes of tensors such a checkpoint also holds that the text model does not read.
    checkpoint_layouts: ClassVar[tuple[str, ...]] = ("default",)
    checkpoint_prefixes: ClassVar[tuple[str, ...]] = ("",)
    ignored_checkpoint_prefixes: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: ModelConfig, *, tp_rank=0, tp_size=1, tp_group=None, device="cpu",
                 block_size=16, kv_cache_dtype="auto", kernel="auto"):
        super().__init__()
        if config.architecture not in self.architectures:
            raise ValueError(f"architecture={config.architecture!r} is not served by {type(self).__name__} "
                             f"({', '.join(self.architectures)}); build it with ray_attn.model.build_model")
        chunk = config.attention_chunk_size
        if "chunked_attention" in config.layer_kinds() and chunk % block_size:
            raise ValueError(f"attention_chunk_size={chunk} must be a multiple of block_size={block_size} "
                             "(local attention reads whole pages of one chunk)")
        self.config = config
        self.tp = TPGroup(tp_rank, tp_size, tp_group)
        self.device = torch.device(device)
        self.dtype = getattr(torch, config.dtype)
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype
        self.cache_dtype = FP8_DTYPE if is_fp8_kv_cache(kv_cache_dtype) else self.dtype
        dd = dict(dtype=self.dtype, device=self.device)
        V, E = config.vocab_size, config.hidden_size
        # FP8 weights (ModelConfig.quantization): the layers' linears, each converted as soon as
        # its layer is built, so that at most one layer's full-precision weights are ever allocated.
        self.quant_config = parse_quantization(config.quantization)
        check_model(self.quant_config, config.architecture, config.num_local_experts is not None)
        self.embed_tokens = new_param(V, E, **dd)
        self.layers = nn.ModuleList(
            self._quantize_layer(i, self.layer_class(config, i, self.tp, block_size=block_size,
                                                     kv_cache_dtype=kv_cache_dtype, kernel=kernel, **dd))
            for i in range(config.num_hidden_layers))
        self.norm = self.norm_class(E, config.rms_norm_eps, **dd)
        self.lm_head = self.embed_tokens if config.tie_word_embeddings else new_param(V, E, **dd)
        self.rotary = None if config.use_alibi else self.make_rotary()
        attn0 = self.layers[0].self_attn
        self.num_heads, self.num_kv_heads = attn0.num_heads, attn0.num_kv_heads
        self.head_size = config.head_size
        self.kernel_name: str = attn0.impl.kernel.name
        self.kv_caches: list[torch.Tensor] | None = None
        self.kv_cache_stack: torch.Tensor | None = None  # [layers, *kv_cache_shape]; see allocate_kv_cache
        self._attn_out = torch.zeros(0, self.num_heads, self.head_size, **dd)

    def make_rotary(self) -> nn.Module:
        """The step's position encoding: ``cos_sin(positions, dtype)`` feeds every layer."""
        c = self.config
        return RotaryEmbedding(c.head_size, c.max_position_embeddings, c.rope_theta, c.rope_scaling,
                               device=self.device)

    def _quantize_layer(self, i: int, layer: nn.Module) -> nn.Module:
        """qkv, o_proj, gate_up and down_proj in FP8; the embedding, norms and LM head stay in the
        model dtype (as vLLM keeps them)."""
        if self.quant_config is not None:
            for name, m in layer.named_modules():
                if isinstance(m, Fp8Linear):
                    m.quantize_(self.quant_config, f"layers.{i}.{name}")
        return layer

    # -- weights ----------------------------------------------------------------------------
    def layer_shards(self, i: int, layer: nn.Module, layout: str = "default") -> dict[str, Shard]:
        raise NotImplementedError

    def weight_shards(self, layout: str | None = None) -> dict[str, Shard]:
        """Every parameter of this rank by its HF checkpoint name, with where it sits in the full
        tensor (a ``FusedShard`` for a tensor this rank holds in several pieces), in checkpoint
        ``layout`` (one of ``checkpoint_layouts``; the first when unset)."""
        layout = layout or self.checkpoint_layouts[0]
        s = {self.embed_name: replicated(self.embed_tokens, "embedding")}
        for i, layer in enumerate(self.layers):
            s.update(self.layer_shards(i, layer) if layout == "default" else self.layer_shards(i, layer, layout))
        s[self.final_norm_name] = self.norm.shard()
        if not self.config.tie_word_embeddings:
            s["lm_head.weight"] = replicated(self.lm_head)
        return self._with_scales(s)

    def _with_scales(self, shards: dict) -> dict:
        """Each stored FP8 weight's scales under the checkpoint names beside it (``x.weight`` ->
        ``x.weight_scale`` / ``x.weight_scale_inv``, ``x.input_scale``)."""
        out = {}
        for name, shard in shards.items():
            out[name] = shard
            if shard.companions:
                module = name.rpartition(".")[0]
                if self.quant_config.is_layer_skipped(module):
                    raise ValueError(f"quantization_config ignores {module}, which this model runs in FP8 "
                                     "(checkpoints with some of qkv/o/gate/up/down unquantized are not implemented)")
                out.update({f"{module}.{suffix}": c for suffix, c in shard.companions.items()})
        return out

    def process_weights_after_loading(self) -> None:
        """vLLM's hook of that name: quantize online-FP8 weights, settle fused static input scales.
        Every rank runs it in the same module order (a row-parallel online weight's scales are
        reduced over the TP group)."""
        for m in self.modules():
            if isinstance(m, Fp8Linear):
                m.process_weights_after_loading()

    def load_weights(self, folder: str) -> None:
        """Load the first (layout, prefix) whose every name the checkpoint holds; with none, the
        error names what the first layout lacks."""
        names = set(weights.checkpoint_names(folder))
        kw = dict(tied=self.config.tie_word_embeddings, architecture=self.config.architecture,
                  ignored_prefixes=self.ignored_checkpoint_prefixes)
        for layout in self.checkpoint_layouts:
            shards = self.weight_shards(layout)
            for prefix in self.checkpoint_prefixes:
                if all(prefix + n in names for n in shards):
                    weights.load_checkpoint({prefix + n: s for n, s in shards.items()}, folder, prefix=prefix, **kw)
                    self.process_weights_after_loading()
                    if self.config.quantization == GGUF:  # the 4-bit blocks as stored
                        gguf_weights.pack_q4(self, folder)
                    return
        weights.load_checkpoint(self.weight_shards(), folder, **kw)  # raises, naming the missing tensors

    def init_random_weights(self, seed: int, std: float | None = None) -> None:
        """The model ``save_random_checkpoint(config, folder, seed)`` writes (on CPU; see
        ``random_full_tensor`` for the scales), sliced to this rank."""
        q = self.quant_config
        if q is not None and q.is_checkpoint_fp8_serialized:
            raise ValueError(f"random weights cannot stand for a quantized checkpoint ({q.describe()}); "
                             "use quantization='fp8' to quantize random weights")
        tied = self.config.tie_word_embeddings
        for name, shard in self.weight_shards().items():
            full = weights.random_full_tensor(name, shard.full_shape, seed, init=shard.init, std=std,
                                              tied=tied, device=self.device)
            for piece in shard.pieces():
                piece.dest.copy_(full[piece.index()])
            del full  # one full tensor at a time, so an 8B model initialises in place on the GPU
        self.process_weights_after_loading()

    # -- KV cache ---------------------------------------------------------------------------
    def set_calculate_kv_scales(self, on: bool = True) -> None:
        """Have every layer take its fp8 scales from the next batch it sees (vLLM's
        calculate_kv_scales).  The worker turns this on after capturing CUDA graphs, so that the
        capture's warm-up runs (placeholder inputs) do not set the scales."""
        for m in self.modules():
            if isinstance(m, ParallelAttention):
                m.attn_layer.calculate_kv_scales = on

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return FlashAttentionBackend.get_kv_cache_shape(num_blocks, self.block_size,
                                                        self.num_kv_heads, self.head_size)

    def kv_cache_bytes_per_block(self) -> int:
        per_layer = 2 * self.block_size * self.num_kv_heads * self.head_size * self.cache_dtype.itemsize
        return per_layer * len(self.layers)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = self.kv_cache_stack = None  # free the old cache before the new one is allocated
        # Every layer's cache is a contiguous view of one tensor [layers, 2, num_blocks, ...], so
        # the kernels see what they always did, and one block's bytes in every layer form one
        # strided slice: the host tier moves n blocks with one index_select, not one per layer
        # (runtime/kv_tiers.py).  Zeros, not empty: kernels load whole pages, and 0 * NaN from a
        # stale slot would poison a row.
        self.kv_cache_stack = torch.zeros((len(self.layers),) + self.kv_cache_shape(num_blocks),
                                          dtype=self.cache_dtype, device=self.device)
        self.kv_caches = list(self.kv_cache_stack.unbind(0))

    # -- forward ----------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_tokens)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: FlashAttentionMetadata | None,
                attn_out: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden states [T, hidden]; ``attn_metadata=None`` is a profiling run.

        ``attn_out`` [T, heads, head_size] is the attention output scratch; a CUDA graph passes
        its own, because the shared one is reallocated when a longer step comes."""
        T = input_ids.shape[0]
        caches = self.kv_caches
        if attn_metadata is not None:
            self._check_step(attn_metadata)
        if caches is None:
            caches = [self._attn_out.new_empty(self.kv_cache_shape(0))] * len(self.layers)
        if attn_out is None:
            if self._attn_out.shape[0] < T:
                self._attn_out = self._attn_out.new_zeros(T, self.num_heads, self.head_size)
            attn_out = self._attn_out[:T]
        cos_sin = None if self.rotary is None else self.rotary.cos_sin(positions, self.dtype)
        h, delta = self.embed(input_ids), None
        for layer, cache in zip(self.layers, caches):
            if hasattr(layer, "forward_residual"):  # its output's add runs in the next norm's kernel
                h, delta = layer.forward_residual(h, delta, cos_sin, cache, attn_metadata, attn_out)
            else:
                h, delta = layer(h if delta is None else h + delta, cos_sin, cache, attn_metadata, attn_out), None
        if delta is None:
            return self.norm(h)
        if type(self.norm) is RMSNorm:
            return add_rms_norm(h, delta, self.norm.weight, self.norm.eps)[1]
        return self.norm(h + delta)

    def _check_step(self, m: FlashAttentionMetadata) -> None:
        if self.kv_caches is None:
            raise RuntimeError("allocate_kv_cache() must run before a step with attention metadata")
        chunk = self.config.attention_chunk_size
        if (m.local_attn_metadata is None and "chunked_attention" in self.config.layer_kinds()
                and m.max_seq_len > chunk):
            raise ValueError(f"chunked_attention layers need attn_metadata.local_attn_metadata once a "
                             f"sequence exceeds attention_chunk_size={chunk} (max_seq_len={m.max_seq_len})")

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """float32 [B, vocab], the same on every rank (the LM head is replicated)."""
        logits = linear(hidden[logits_indices], self.lm_head).float()
        cap = self.config.final_logit_soft_cap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap  # HF Gemma-2's order: divide, tanh, multiply
        return logits
