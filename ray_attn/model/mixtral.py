"""Mixtral checkpoints (HF ``MixtralForCausalLM``): Llama's attention, every MLP a sparse MoE.

Routing: softmax over the experts, the top ``num_experts_per_tok`` (2 in every release),
renormalised to sum to 1 (transformers always renormalises Mixtral), each weight multiplying its
expert's output.  No shared expert, no dense layers.  transformers 5 writes the experts as the
hub's checkpoints hold them, ``block_sparse_moe.experts.{e}.w1/w3/w2`` (gate, up, down) and
``block_sparse_moe.gate`` (the router); checkpoints in its in-memory form
(``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj``) load too.
"""

from __future__ import annotations

from torch import nn

from ray_attn.config import ModelConfig
from ray_attn.model.llama import LlamaDecoderLayer, LlamaForCausalLM
from ray_attn.model.moe import SparseMoeBlock
from ray_attn.model.tp import TPGroup


def sparse_block(config: ModelConfig, tp: TPGroup, *, scoring: str, renormalize: bool, **dd) -> SparseMoeBlock:
    return SparseMoeBlock(config.hidden_size, config.num_local_experts, config.num_experts_per_tok,
                          config.expert_intermediate_size, tp, scoring=scoring, renormalize=renormalize,
                          shared_intermediate=config.shared_expert_intermediate_size, **dd)


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config: ModelConfig, layer_idx: int, tp: TPGroup, **dd) -> nn.Module:
        return sparse_block(config, tp, scoring="softmax", renormalize=True, **dd)


class MixtralForCausalLM(LlamaForCausalLM):
    architectures = ("MixtralForCausalLM",)
    layer_class = MixtralDecoderLayer
    checkpoint_layouts = ("default", "fused")

    def layer_shards(self, i, layer, layout="default"):
        p, a = f"model.layers.{i}.", layer.self_attn
        moe = (p + "block_sparse_moe.", "w123") if layout == "default" else (p + "mlp.", "fused")
        return {
            **a.hf_shards(p + "self_attn."), **layer.mlp.hf_shards(moe[0], router="gate", fmt=moe[1]),
            p + "input_layernorm.weight": layer.input_layernorm.shard(),
            p + "post_attention_layernorm.weight": layer.post_attention_layernorm.shard(),
        }
