"""A tensor-parallel Llama-style decoder built on the FlashAttention backend."""

from ray_attn.model.llama import LlamaForCausalLM
from ray_attn.model.tp import TPGroup
from ray_attn.model.weights import save_random_checkpoint

__all__ = ["LlamaForCausalLM", "TPGroup", "save_random_checkpoint"]
