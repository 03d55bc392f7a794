"""Llama 4 text checkpoints (HF ``Llama4ForCausalLM``, and the text part of a
``Llama4ForConditionalGeneration``: its ``text_config`` and ``language_model.`` tensors).

What differs from Llama, all as transformers' ``modeling_llama4.py`` computes it:

- **iRoPE.** ``no_rope_layers[i]`` (1 = RoPE, HF's inverted name) picks RoPE layers, which are
  also the chunked-local ones (``layer_types``); the others are NoPE layers with full attention.
  RoPE is the complex (interleaved) form: pairs (x[2j], x[2j+1]) rotate by frequency j, not the
  halves Llama rotates, since the checkpoints keep Meta's q/k row order.
- **L2 q/k norm** (``use_qk_norm``), on RoPE layers only, *after* RoPE, without a weight.
- **Temperature tuning** (``attn_temperature_tuning``), on NoPE layers only: q is scaled by
  ``1 + attn_scale * log1p(floor((pos + 1) / floor_scale))`` at absolute position ``pos``.
- **MoE** on ``moe_layers`` (``interleave_moe_layer_step``), dense SwiGLU of
  ``intermediate_size_mlp`` elsewhere (our ``intermediate_size``).  The router takes the top k of
  its logits and a sigmoid of those; the score scales the expert's *input*; a shared expert
  (as wide as a routed one) adds for every token.  Experts are stored fused and input-major:
  ``feed_forward.experts.gate_up_proj`` [E, H, 2I], ``down_proj`` [E, I, H].

The per-step work -- cos/sin of the positions (computed from them, as HF does, instead of a table:
Llama 4's context is 10M positions) and the temperature scales -- is done once per forward.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ray_attn.config import ModelConfig
from ray_attn.model.attention import ParallelAttention
from ray_attn.model.fused_llama4 import llama4_qk_launch, llama4_qk_ok
from ray_attn.model.layers import rope_inv_freq
from ray_attn.model.llama import LlamaDecoderLayer, LlamaForCausalLM
from ray_attn.model.mixtral import sparse_block
from ray_attn.model.tp import TPGroup


class Llama4Positions(NamedTuple):
    cos: torch.Tensor  # [T, 1, D/2] float32
    sin: torch.Tensor
    temperature: torch.Tensor | None  # [T, 1, 1] float32, the NoPE layers' q scale


class Llama4Rotary(nn.Module):
    def __init__(self, config: ModelConfig, device):
        super().__init__()
        inv = rope_inv_freq(config.head_size, config.rope_theta, config.rope_scaling)
        self.register_buffer("inv_freq", inv.to(device), persistent=False)
        self.tuning = config.attn_temperature_tuning
        self.floor_scale, self.attn_scale = config.floor_scale, config.attn_scale

    def cos_sin(self, positions: torch.Tensor, dtype) -> Llama4Positions:
        pos = positions.float()
        freqs = pos[:, None, None] * self.inv_freq  # HF: position * inv_freq in float32, then polar
        temp = None
        if self.tuning:
            temp = (torch.log1p(torch.floor((pos + 1.0) / self.floor_scale)) * self.attn_scale + 1.0)[:, None, None]
        return Llama4Positions(freqs.cos(), freqs.sin(), temp)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's ``apply_rotary_emb``: (x[2j] + i x[2j+1]) * e^(i theta_j), in float32, rounded once."""
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2).to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Llama4TextL2Norm: x / rms(x) over the head in float32, no weight."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Llama4Attention(ParallelAttention):
    def __init__(self, config: ModelConfig, layer_idx: int, tp: TPGroup, **kw):
        super().__init__(config, layer_idx, tp, **kw)
        self.use_rope = config.uses_rope(layer_idx)
        self.qk_norm_eps = config.rms_norm_eps if config.use_qk_norm and self.use_rope else None
        self.temperature = config.attn_temperature_tuning and not self.use_rope

    def forward(self, x, step: Llama4Positions, kv_cache, attn_metadata, out):
        D, nq, nk = self.head_size, self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x)  # x may come quantized for FP8 weights (fp8.QuantizedActivation)
        T = qkv.shape[0]
        qk, v = qkv.split([(nq + nk) * D, nk * D], dim=-1)
        qk = qk.view(T, nq + nk, D)
        cos, sin = (step.cos, step.sin) if self.use_rope else (None, None)
        temp = step.temperature if self.temperature else None
        if llama4_qk_ok(qk, cos, sin, temp):  # CUDA: RoPE, the L2 norm or the temperature, one kernel
            q, k = llama4_qk_launch(qk, nq, cos, sin, self.qk_norm_eps, temp)
            self.impl.forward(self.attn_layer, q, k, v.view(T, nk, D), kv_cache, attn_metadata, out)
            return self.o_proj(out.view(T, nq * D))
        q, k = qk.split([nq, nk], dim=1)
        if self.use_rope:
            q, k = rope_interleaved(q, step.cos, step.sin), rope_interleaved(k, step.cos, step.sin)
        if self.qk_norm_eps is not None:
            q, k = l2_norm(q, self.qk_norm_eps), l2_norm(k, self.qk_norm_eps)
        if self.temperature:
            q = (q * step.temperature).to(q.dtype)
        self.impl.forward(self.attn_layer, q, k, v.view(T, nk, D), kv_cache, attn_metadata, out)
        return self.o_proj(out.view(T, nq * D))


class Llama4DecoderLayer(LlamaDecoderLayer):
    attention_class = Llama4Attention

    def make_mlp(self, config: ModelConfig, layer_idx: int, tp: TPGroup, **dd) -> nn.Module:
        if layer_idx not in config.moe_layer_ids:
            return super().make_mlp(config, layer_idx, tp, **dd)  # intermediate_size_mlp wide
        block = sparse_block(config, tp, scoring="sigmoid", renormalize=False, **dd)
        block.apply_router_weight_on_input = True
        return block


class Llama4ForCausalLM(LlamaForCausalLM):
    architectures = ("Llama4ForCausalLM",)
    layer_class = Llama4DecoderLayer
    checkpoint_prefixes = ("", "language_model.")
    ignored_checkpoint_prefixes = ("vision_model.", "multi_modal_projector.")

    def make_rotary(self) -> nn.Module:
        return Llama4Rotary(self.config, self.device)

    def layer_shards(self, i, layer, layout="default"):
        p, a, m = f"model.layers.{i}.", layer.self_attn, layer.mlp
        ff = p + "feed_forward."
        moe = i in self.config.moe_layer_ids
        return {
            **a.hf_shards(p + "self_attn."),
            **(m.hf_shards(ff, router="router", fmt="fused_t") if moe else m.hf_shards(ff)),
            p + "input_layernorm.weight": layer.input_layernorm.shard(),
            p + "post_attention_layernorm.weight": layer.post_attention_layernorm.shard(),
        }
