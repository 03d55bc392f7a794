"""Qwen3 checkpoints (HF ``Qwen3ForCausalLM``): Llama's block with per-head q/k RMSNorm.

No projection biases; q and k are RMS-normalised over each head's ``head_dim`` values
(``self_attn.q_norm``, ``self_attn.k_norm``: one weight of head_dim shared by every head) after
the projection and before RoPE.  ``head_dim`` is explicit in Qwen3 configs (128 for every released
size) and need not be hidden_size / heads.  Otherwise Llama's: RMSNorm before attention and MLP,
SwiGLU, RoPE, GQA, tensor names.
"""

from __future__ import annotations

from ray_attn.model.llama import LlamaDecoderLayer, LlamaForCausalLM


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_options = dict(qk_norm=True)


class Qwen3ForCausalLM(LlamaForCausalLM):
    architectures = ("Qwen3ForCausalLM",)
    layer_class = Qwen3DecoderLayer
