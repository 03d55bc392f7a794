"""Tensor-parallel decoders (Llama/Mistral, MPT, Gemma-2, Qwen2, Qwen3) built on the FlashAttention backend."""

from ray_attn.model.base import CausalLM
from ray_attn.model.gemma2 import Gemma2ForCausalLM
from ray_attn.model.llama import LlamaForCausalLM
from ray_attn.model.mpt import MptForCausalLM
from ray_attn.model.qwen2 import Qwen2ForCausalLM
from ray_attn.model.qwen3 import Qwen3ForCausalLM
from ray_attn.model.registry import MODELS, build_model, model_class, save_random_checkpoint
from ray_attn.model.tp import TPGroup

__all__ = ["CausalLM", "Gemma2ForCausalLM", "LlamaForCausalLM", "MODELS", "MptForCausalLM", "Qwen2ForCausalLM",
           "Qwen3ForCausalLM", "TPGroup", "build_model", "model_class", "save_random_checkpoint"]
