"""Tensor-parallel decoders (Llama/Mistral, MPT, Gemma-2, Qwen2, Qwen3; the sparse Mixtral, Qwen3-MoE and
Llama 4) built on the FlashAttention backend."""

from ray_attn.model.base import CausalLM
from ray_attn.model.gemma2 import Gemma2ForCausalLM
from ray_attn.model.llama import LlamaForCausalLM
from ray_attn.model.llama4 import Llama4ForCausalLM
from ray_attn.model.mixtral import MixtralForCausalLM
from ray_attn.model.mpt import MptForCausalLM
from ray_attn.model.qwen2 import Qwen2ForCausalLM
from ray_attn.model.qwen3 import Qwen3ForCausalLM
from ray_attn.model.qwen3_moe import Qwen3MoeForCausalLM
from ray_attn.model.registry import MODELS, build_model, model_class, save_random_checkpoint
from ray_attn.model.tp import TPGroup

__all__ = ["CausalLM", "Gemma2ForCausalLM", "Llama4ForCausalLM", "LlamaForCausalLM", "MODELS", "MixtralForCausalLM",
           "MptForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "TPGroup", "build_model", "model_class", "save_random_checkpoint"]
