"""The self-attention every family shares: fused q/k/v projection, optional RoPE, the paged
FlashAttention backend, output projection.

What differs between families is configuration, not code: the scale (``ModelConfig.attention_scale``),
ALiBi slopes, soft cap, q/k/v clipping and the layer's kind (full, sliding, chunked) all come from
``ModelConfig``; checkpoint names are the family's business (its ``layer_shards``).  What a family
always has or never has is a constructor option: q/k/v biases (Qwen2) and a per-head RMSNorm on q
and k before RoPE (Qwen3).
"""

from __future__ import annotations

from torch import nn

from ray_attn.backend.flash_attn import AttentionLayer, FlashAttentionImpl
from ray_attn.config import ModelConfig
from ray_attn.model.fused import qk_norm_rope
from ray_attn.model.layers import RMSNorm, RotaryEmbedding, alibi_slopes
from ray_attn.model.parallel_linear import RowParallelLinear, qkv_parallel
from ray_attn.model.tp import TPGroup


class ParallelAttention(nn.Module):
    """Query heads split over ranks, KV heads split or replicated (``qkv_parallel``); o_proj is
    row-parallel, so the layer's output is all-reduced.

    ``qkv_bias``: q, k and v projections carry biases, cut like their rows.  ``qk_norm``: q and k
    are RMS-normalised per head (over head_size, weights shared by the heads: replicated on every
    rank) before RoPE."""

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TPGroup, *, dtype, device,
                 block_size, kv_cache_dtype, kernel, qkv_bias: bool = False, qk_norm: bool = False):
        super().__init__()
        H, D = config.num_attention_heads, config.head_size
        self.qkv_proj, self.num_heads, self.num_kv_heads = qkv_parallel(
            config.hidden_size, H, config.num_key_value_heads, D, tp, bias=qkv_bias, dtype=dtype,
            device=device)
        self.q_norm = self.k_norm = None
        if qk_norm:
            self.q_norm = RMSNorm(D, config.rms_norm_eps, dtype=dtype, device=device)
            self.k_norm = RMSNorm(D, config.rms_norm_eps, dtype=dtype, device=device)
        self.o_proj = RowParallelLinear(H * D, config.hidden_size, tp.rank * self.num_heads * D,
                                        self.num_heads * D, tp, dtype=dtype, device=device)
        self.head_size = D
        self.clip_qkv = config.clip_qkv
        kind = config.layer_kinds()[layer_idx]
        slopes = None
        if config.use_alibi:
            first = tp.rank * self.num_heads
            slopes = alibi_slopes(H, config.alibi_bias_max)[first:first + self.num_heads]
        self.impl = FlashAttentionImpl(
            self.num_heads, D, config.attention_scale, self.num_kv_heads, slopes,
            config.sliding_window if kind == "sliding_attention" else None, kv_cache_dtype,
            logits_soft_cap=config.logits_soft_cap, use_irope=kind == "chunked_attention",
            dtype=dtype, block_size=block_size, device=device, kernel=kernel)
        self.attn_layer = AttentionLayer(device=device)

    def forward(self, x, cos_sin, kv_cache, attn_metadata, out):
        D, nq, nk = self.head_size, self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x)  # x may come quantized for FP8 weights (fp8.QuantizedActivation)
        T = qkv.shape[0]
        if self.clip_qkv is not None:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        qk, v = qkv.split([(nq + nk) * D, nk * D], dim=-1)
        qk = qk.view(T, nq + nk, D)
        if self.q_norm is not None:  # per-head norms and RoPE: one kernel on CUDA
            q, k = qk_norm_rope(qk, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                *(cos_sin if cos_sin is not None else (None, None)), nq)
        else:
            if cos_sin is not None:
                qk = RotaryEmbedding.apply(qk, *cos_sin)  # q and k heads rotated in one pass
            q, k = qk.split([nq, nk], dim=1)
        self.impl.forward(self.attn_layer, q, k, v.view(T, nk, D), kv_cache, attn_metadata, out)
        return self.o_proj(out.view(T, nq * D))

    def hf_shards(self, prefix: str) -> dict:
        """Checkpoints with separate q/k/v/o tensors under HF's Llama names (Llama, Gemma, Qwen),
        and the biases and q/k norms under Qwen's."""
        names = ("q_proj", "k_proj", "v_proj")
        s = {f"{prefix}{n}.weight": self.qkv_proj.shard(i) for i, n in enumerate(names)}
        if self.qkv_proj.bias is not None:
            s.update({f"{prefix}{n}.bias": self.qkv_proj.bias_shard(i) for i, n in enumerate(names)})
        s[prefix + "o_proj.weight"] = self.o_proj.shard()
        if self.q_norm is not None:
            s[prefix + "q_norm.weight"] = self.q_norm.shard()
            s[prefix + "k_norm.weight"] = self.k_norm.shard()
        return s

