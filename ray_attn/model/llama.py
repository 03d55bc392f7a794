"""Llama (and Mistral) checkpoints: RMSNorm before attention and MLP, SwiGLU, RoPE.

Llama 4 runs NoPE on its global (non-chunked) layers; we keep RoPE on every layer so that a plain
HF Llama checkpoint computes exactly what transformers computes.  ``use_alibi`` swaps RoPE for
ALiBi (random-weight configs: no Llama checkpoint has it).
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from ray_attn.config import ModelConfig
from ray_attn.model.attention import ParallelAttention
from ray_attn.model.base import CausalLM
from ray_attn.model.fused import add_rms_norm, rms_norm
from ray_attn.model.layers import RMSNorm
from ray_attn.model.mlp import MLP
from ray_attn.model.tp import TPGroup


class LlamaDecoderLayer(nn.Module):
    # ParallelAttention's family options (Qwen2's q/k/v biases, Qwen3's q/k norms); none for Llama.
    attention_options: ClassVar[dict] = {}
    attention_class: ClassVar[type[ParallelAttention]] = ParallelAttention

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TPGroup, **kw):
        super().__init__()
        dd = dict(dtype=kw["dtype"], device=kw["device"])
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **dd)
        self.self_attn = self.attention_class(config, layer_idx, tp, **kw, **self.attention_options)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **dd)
        self.mlp = self.make_mlp(config, layer_idx, tp, **dd)

    def make_mlp(self, config: ModelConfig, layer_idx: int, tp: TPGroup, **dd) -> nn.Module:
        """The layer's feed-forward block (the sparse families put their SparseMoeBlock here)."""
        return MLP(config.hidden_size, config.intermediate_size, tp, activation="silu", **dd)

    def forward(self, h, cos_sin, kv_cache, attn_metadata, out):
        h, m = self.forward_residual(h, None, cos_sin, kv_cache, attn_metadata, out)
        return h + m

    def forward_residual(self, h, delta, cos_sin, kv_cache, attn_metadata, out):
        """(the residual stream, this layer's MLP output not yet added to it), after adding
        ``delta`` (the layer before's MLP output, or None): the model's layer loop passes each
        layer's output to the next, so every residual add runs inside the norm kernel after it
        (vLLM's fused_add_rms_norm; the same rounding as torch's add)."""
        norm = self.input_layernorm
        fusable = type(norm) is RMSNorm
        # FP8 weights: the norm quantizes for qkv too.
        quant = fusable and self.self_attn.qkv_proj.wants_fp8_input(h)
        if delta is not None and fusable:
            h, x = add_rms_norm(h, delta, norm.weight, norm.eps, quant=quant)
        else:
            h = h if delta is None else h + delta
            x = rms_norm(h, norm.weight, norm.eps, quant=True) if quant else norm(h)
        a = self.self_attn(x, cos_sin, kv_cache, attn_metadata, out)
        norm = self.post_attention_layernorm
        quant = isinstance(self.mlp, MLP) and self.mlp.gate_up.wants_fp8_input(h)
        h, x = add_rms_norm(h, a, norm.weight, norm.eps, quant=quant)
        return h, self.mlp(x)


class LlamaForCausalLM(CausalLM):
    architectures = ("LlamaForCausalLM", "MistralForCausalLM")
    layer_class = LlamaDecoderLayer
    norm_class = RMSNorm
    embed_name = "model.embed_tokens.weight"
    final_norm_name = "model.norm.weight"

    def layer_shards(self, i, layer):
        p, a, m = f"model.layers.{i}.", layer.self_attn, layer.mlp
        return {
            **a.hf_shards(p + "self_attn."), **m.hf_shards(p + "mlp."),
            p + "input_layernorm.weight": layer.input_layernorm.shard(),
            p + "post_attention_layernorm.weight": layer.post_attention_layernorm.shard(),
        }
