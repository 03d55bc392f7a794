"""Gemma-2 checkpoints (HF ``Gemma2ForCausalLM``): soft caps and alternating sliding/full layers.

Each block norms before and after both attention and MLP (four ``x * (1 + weight)`` RMSNorms),
the MLP is GeGLU (tanh GELU), the embedding is scaled by sqrt(hidden_size), the attention scale is
``query_pre_attn_scalar ** -0.5``, attention scores are soft-capped (``logits_soft_cap``) and so
are the final logits (``final_logit_soft_cap``); all of those but the norms and the embedding
scale are ``ModelConfig`` fields the shared layers read.
"""

from __future__ import annotations

import torch
from torch import nn

from ray_attn.config import ModelConfig
from ray_attn.model.attention import ParallelAttention
from ray_attn.model.base import CausalLM
from ray_attn.model.layers import GemmaRMSNorm
from ray_attn.model.mlp import MLP
from ray_attn.model.tp import TPGroup


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, tp: TPGroup, **kw):
        super().__init__()
        dd = dict(dtype=kw["dtype"], device=kw["device"])
        E, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(E, eps, **dd)
        self.self_attn = ParallelAttention(config, layer_idx, tp, **kw)
        self.post_attention_layernorm = GemmaRMSNorm(E, eps, **dd)
        self.pre_feedforward_layernorm = GemmaRMSNorm(E, eps, **dd)
        self.mlp = MLP(E, config.intermediate_size, tp, activation="gelu_pytorch_tanh", **dd)
        self.post_feedforward_layernorm = GemmaRMSNorm(E, eps, **dd)

    def forward(self, h, cos_sin, kv_cache, attn_metadata, out):
        a = self.self_attn(self.input_layernorm(h), cos_sin, kv_cache, attn_metadata, out)
        h = h + self.post_attention_layernorm(a)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma2ForCausalLM(CausalLM):
    architectures = ("Gemma2ForCausalLM",)
    layer_class = Gemma2DecoderLayer
    norm_class = GemmaRMSNorm
    embed_name = "model.embed_tokens.weight"
    final_norm_name = "model.norm.weight"

    def __init__(self, config: ModelConfig, **kw):
        super().__init__(config, **kw)
        # HF rounds sqrt(hidden) to float32 and then to the model dtype (55.4256 is 55.5 in bf16)
        # before multiplying; the rounded factor is part of the checkpoint's function.
        self.embed_scale = torch.tensor(config.hidden_size ** 0.5).to(self.dtype).item()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.embed_scale

    def layer_shards(self, i, layer):
        p, a, m = f"model.layers.{i}.", layer.self_attn, layer.mlp
        return {
            **a.hf_shards(p + "self_attn."), **m.hf_shards(p + "mlp."),
            **{p + n + ".weight": getattr(layer, n).shard() for n in (
                "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm")},
        }
