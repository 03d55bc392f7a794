"""Qwen2 / Qwen2.5 checkpoints (HF ``Qwen2ForCausalLM``): Llama's block with q/k/v biases.

RMSNorm before attention and MLP, SwiGLU, RoPE, GQA; the q, k and v projections carry biases
(o_proj does not), cut over ranks with their rows.  Tensor names are Llama's plus
``self_attn.{q,k,v}_proj.bias``.  Sliding-window layers (``use_sliding_window``, the layers from
``max_window_layers`` on) are ``layer_types`` by the time a config reaches the model
(``ray_attn.hf_config``).
"""

from __future__ import annotations

from ray_attn.model.llama import LlamaDecoderLayer, LlamaForCausalLM


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention_options = dict(qkv_bias=True)


class Qwen2ForCausalLM(LlamaForCausalLM):
    architectures = ("Qwen2ForCausalLM",)
    layer_class = Qwen2DecoderLayer
