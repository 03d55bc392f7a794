"""Qwen3-MoE checkpoints (HF ``Qwen3MoeForCausalLM``): Qwen3's attention (per-head q/k RMSNorm),
sparse MoE layers, and dense SwiGLU layers where the config says so.

A layer is sparse unless it is in ``mlp_only_layers``, every ``decoder_sparse_step``-th layer
(``ModelConfig.moe_layers`` holds the result, computed by ``ray_attn.hf_config``); dense layers
are ``intermediate_size`` wide, experts ``moe_intermediate_size``.  Routing: softmax over the
experts, the top ``num_experts_per_tok`` (8 of 128 in the released models), renormalised only
with ``norm_topk_prob``, each weight multiplying its expert's output; no shared expert.
transformers 5 writes the experts as the hub holds them, ``mlp.experts.{e}.gate_proj/up_proj/
down_proj``; its in-memory form (``mlp.experts.gate_up_proj`` [E, 2I, H]) loads too.
"""

from __future__ import annotations

from torch import nn

from ray_attn.config import ModelConfig
from ray_attn.model.llama import LlamaForCausalLM
from ray_attn.model.mixtral import sparse_block
from ray_attn.model.moe import SparseMoeBlock
from ray_attn.model.qwen3 import Qwen3DecoderLayer
from ray_attn.model.tp import TPGroup


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def make_mlp(self, config: ModelConfig, layer_idx: int, tp: TPGroup, **dd) -> nn.Module:
        if layer_idx not in config.moe_layer_ids:
            return super().make_mlp(config, layer_idx, tp, **dd)
        return sparse_block(config, tp, scoring="softmax", renormalize=config.norm_topk_prob, **dd)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    architectures = ("Qwen3MoeForCausalLM",)
    layer_class = Qwen3MoeDecoderLayer
    checkpoint_layouts = ("default", "fused")

    def layer_shards(self, i, layer, layout="default"):
        p, a, m = f"model.layers.{i}.", layer.self_attn, layer.mlp
        mlp = (m.hf_shards(p + "mlp.", router="gate", fmt="proj" if layout == "default" else "fused")
               if isinstance(m, SparseMoeBlock) else m.hf_shards(p + "mlp."))
        return {
            **a.hf_shards(p + "self_attn."), **mlp,
            p + "input_layernorm.weight": layer.input_layernorm.shard(),
            p + "post_attention_layernorm.weight": layer.post_attention_layernorm.shard(),
        }
