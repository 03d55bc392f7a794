"""A tensor-parallel Llama-style decoder over the paged FlashAttention backend.

Layout per rank: query heads and the MLP's inner width are split, KV heads split or replicated
(see ``qkv_parallel``); embedding, norms and LM head are replicated, so ``compute_logits``
returns the full vocabulary on every rank without a gather.  Two all-reduces per layer
(o_proj, down_proj).  The per-step work that does not depend on the layer -- RoPE cos/sin, the
attention output buffer -- is done once per forward and shared by every layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ray_attn.backend.cache import FP8_DTYPE, is_fp8_kv_cache
from ray_attn.backend.flash_attn import AttentionLayer, FlashAttentionBackend, FlashAttentionImpl
from ray_attn.config import ModelConfig
from ray_attn.metadata import FlashAttentionMetadata
from ray_attn.model.fused import add_rms_norm
from ray_attn.model.layers import (RMSNorm, RotaryEmbedding, RowParallelLinear, Shard, SwiGLU,
                                   new_param, alibi_slopes, qkv_parallel, replicated)
from ray_attn.model.tp import TPGroup


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, tp: TPGroup, *, dtype, device,
                 block_size, kv_cache_dtype, kernel):
        super().__init__()
        H, D = config.num_attention_heads, config.head_size
        self.qkv_proj, self.num_heads, self.num_kv_heads = qkv_parallel(
            config.hidden_size, H, config.num_key_value_heads, D, tp, dtype=dtype, device=device)
        self.o_proj = RowParallelLinear(H * D, config.hidden_size, tp.rank * self.num_heads * D,
                                        self.num_heads * D, tp, dtype=dtype, device=device)
        self.head_size = D
        kind = config.layer_kinds()[layer_idx]
        slopes = None
        if config.use_alibi:
            first = tp.rank * self.num_heads
            slopes = alibi_slopes(H)[first:first + self.num_heads]
        self.impl = FlashAttentionImpl(
            self.num_heads, D, D ** -0.5, self.num_kv_heads, slopes,
            config.sliding_window if kind == "sliding_attention" else None, kv_cache_dtype,
            logits_soft_cap=config.logits_soft_cap, use_irope=kind == "chunked_attention",
            dtype=dtype, block_size=block_size, device=device, kernel=kernel)
        self.attn_layer = AttentionLayer(device=device)

    def forward(self, x, cos_sin, kv_cache, attn_metadata, out):
        T, D, nq, nk = x.shape[0], self.head_size, self.num_heads, self.num_kv_heads
        qk, v = self.qkv_proj(x).split([(nq + nk) * D, nk * D], dim=-1)
        qk = qk.view(T, nq + nk, D)
        if cos_sin is not None:
            qk = RotaryEmbedding.apply(qk, *cos_sin)  # q and k heads rotated in one pass
        q, k = qk.split([nq, nk], dim=1)
        self.impl.forward(self.attn_layer, q, k, v.view(T, nk, D), kv_cache, attn_metadata, out)
        return self.o_proj(out.view(T, nq * D))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, tp: TPGroup, **kw):
        super().__init__()
        dd = dict(dtype=kw["dtype"], device=kw["device"])
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **dd)
        self.self_attn = LlamaAttention(config, layer_idx, tp, **kw)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **dd)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, tp, **dd)

    def forward(self, h, cos_sin, kv_cache, attn_metadata, out):
        a = self.self_attn(self.input_layernorm(h), cos_sin, kv_cache, attn_metadata, out)
        # The residual add and the next norm in one kernel on CUDA (same numerics as apart).
        norm = self.post_attention_layernorm
        h, x = add_rms_norm(h, a, norm.weight, norm.eps)
        return h + self.mlp(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, *, tp_rank=0, tp_size=1, tp_group=None, device="cpu",
                 block_size=16, kv_cache_dtype="auto", kernel="auto"):
        super().__init__()
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
        self.embed_tokens = new_param(V, E, **dd)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, self.tp, block_size=block_size, kv_cache_dtype=kv_cache_dtype,
                              kernel=kernel, **dd)
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(E, config.rms_norm_eps, **dd)
        self.lm_head = self.embed_tokens if config.tie_word_embeddings else new_param(V, E, **dd)
        # Llama 4 runs NoPE on its global (non-chunked) layers; we keep RoPE on every layer so
        # that a plain HF Llama checkpoint computes exactly what transformers computes.
        self.rotary = None if config.use_alibi else RotaryEmbedding(
            config.head_size, config.max_position_embeddings, config.rope_theta,
            getattr(config, "rope_scaling", None), device=self.device)
        attn0 = self.layers[0].self_attn
        self.num_heads, self.num_kv_heads = attn0.num_heads, attn0.num_kv_heads
        self.head_size = config.head_size
        self.kernel_name: str = attn0.impl.kernel.name
        self.kv_caches: list[torch.Tensor] | None = None
        self._attn_out = torch.zeros(0, self.num_heads, self.head_size, **dd)

    # -- weights ----------------------------------------------------------------------------
    def weight_shards(self) -> dict[str, Shard]:
        """Every parameter of this rank by its HF checkpoint name, with where it sits in the full tensor."""
        s = {"model.embed_tokens.weight": replicated(self.embed_tokens)}
        for i, layer in enumerate(self.layers):
            p, a, m = f"model.layers.{i}.", layer.self_attn, layer.mlp
            s.update({
                p + "self_attn.q_proj.weight": a.qkv_proj.shard(0),
                p + "self_attn.k_proj.weight": a.qkv_proj.shard(1),
                p + "self_attn.v_proj.weight": a.qkv_proj.shard(2),
                p + "self_attn.o_proj.weight": a.o_proj.shard(),
                p + "mlp.gate_proj.weight": m.gate_up.shard(0),
                p + "mlp.up_proj.weight": m.gate_up.shard(1),
                p + "mlp.down_proj.weight": m.down.shard(),
                p + "input_layernorm.weight": replicated(layer.input_layernorm.weight),
                p + "post_attention_layernorm.weight": replicated(layer.post_attention_layernorm.weight),
            })
        s["model.norm.weight"] = replicated(self.norm.weight)
        if not self.config.tie_word_embeddings:
            s["lm_head.weight"] = replicated(self.lm_head)
        return s

    def load_weights(self, folder: str) -> None:
        from ray_attn.model.weights import load_checkpoint
        load_checkpoint(self.weight_shards(), folder, tied=self.config.tie_word_embeddings)

    def init_random_weights(self, seed: int, std: float | None = None) -> None:
        """The model ``save_random_checkpoint(config, folder, seed)`` writes (on CPU; see
        ``random_full_tensor`` for the scales), sliced to this rank."""
        from ray_attn.model.weights import random_full_tensor
        tied = self.config.tie_word_embeddings
        for name, shard in self.weight_shards().items():
            full = random_full_tensor(name, shard.full_shape, seed, std=std, tied=tied, device=self.device)
            shard.dest.copy_(full[shard.index()])
            del full  # one full tensor at a time, so an 8B model initialises in place on the GPU

    # -- KV cache ---------------------------------------------------------------------------
    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return FlashAttentionBackend.get_kv_cache_shape(num_blocks, self.block_size,
                                                        self.num_kv_heads, self.head_size)

    def kv_cache_bytes_per_block(self) -> int:
        per_layer = 2 * self.block_size * self.num_kv_heads * self.head_size * self.cache_dtype.itemsize
        return per_layer * len(self.layers)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = None  # free the old cache before the new one is allocated
        # Zeros, not empty: kernels load whole pages, and 0 * NaN from a stale slot would poison a row.
        self.kv_caches = [torch.zeros(self.kv_cache_shape(num_blocks), dtype=self.cache_dtype,
                                      device=self.device) for _ in self.layers]

    # -- forward ----------------------------------------------------------------------------
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
        h = F.embedding(input_ids, self.embed_tokens)
        for layer, cache in zip(self.layers, caches):
            h = layer(h, cos_sin, cache, attn_metadata, attn_out)
        return self.norm(h)

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
        return F.linear(hidden[logits_indices], self.lm_head).float()
