"""MPT checkpoints (MosaicML; HF ``MptForCausalLM``): the ALiBi family.

Pre-norm blocks with bias-free LayerNorms (``norm_1``, ``norm_2``, ``norm_f``), one fused ``Wqkv``
projection, a plain GELU MLP (``up_proj``, ``down_proj``), no position embedding (ALiBi with
``attn_config.alibi_bias_max``), embedding tied to the LM head.

HF adds ``slope * (key_pos - last_pos)`` to the scores, a function of the key alone; the backend
adds ``-slope * |query_pos - key_pos|``.  Under the causal mask the two differ by a constant per
query row, which softmax cancels.
"""

from __future__ import annotations

from torch import nn

from ray_attn.config import ModelConfig
from ray_attn.model.attention import ParallelAttention
from ray_attn.model.base import CausalLM
from ray_attn.model.layers import LayerNorm
from ray_attn.model.mlp import MLP
from ray_attn.model.tp import TPGroup


class MptBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, tp: TPGroup, **kw):
        super().__init__()
        dd = dict(dtype=kw["dtype"], device=kw["device"])
        self.norm_1 = LayerNorm(config.hidden_size, config.rms_norm_eps, **dd)
        self.self_attn = ParallelAttention(config, layer_idx, tp, **kw)
        self.norm_2 = LayerNorm(config.hidden_size, config.rms_norm_eps, **dd)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, tp, activation="gelu", gated=False, **dd)

    def forward(self, h, cos_sin, kv_cache, attn_metadata, out):
        h = h + self.self_attn(self.norm_1(h), cos_sin, kv_cache, attn_metadata, out)
        return h + self.mlp(self.norm_2(h))


class MptForCausalLM(CausalLM):
    architectures = ("MptForCausalLM",)
    layer_class = MptBlock
    norm_class = LayerNorm
    embed_name = "transformer.wte.weight"
    final_norm_name = "transformer.norm_f.weight"

    def layer_shards(self, i, layer):
        p, a, m = f"transformer.blocks.{i}.", layer.self_attn, layer.mlp
        return {
            p + "norm_1.weight": layer.norm_1.shard(),
            # One checkpoint tensor, q then k then v rows: each rank cuts its heads from all three.
            p + "attn.Wqkv.weight": a.qkv_proj.fused_shard(),
            p + "attn.out_proj.weight": a.o_proj.shard(),
            p + "norm_2.weight": layer.norm_2.shard(),
            p + "ffn.up_proj.weight": m.gate_up.shard(0),
            p + "ffn.down_proj.weight": m.down.shard(),
        }
