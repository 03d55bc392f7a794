"""Which model class serves a config: picked from ``ModelConfig.architecture``, the HF
``architectures`` name its checkpoint declares."""

from __future__ import annotations

import json
import os

from ray_attn.config import ModelConfig
from ray_attn.hf_export import hf_config_dict
from ray_attn.model import weights
from ray_attn.model.base import CausalLM
from ray_attn.model.gemma2 import Gemma2ForCausalLM
from ray_attn.model.llama import LlamaForCausalLM
from ray_attn.model.llama4 import Llama4ForCausalLM
from ray_attn.model.mixtral import MixtralForCausalLM
from ray_attn.model.mpt import MptForCausalLM
from ray_attn.model.qwen2 import Qwen2ForCausalLM
from ray_attn.model.qwen3 import Qwen3ForCausalLM
from ray_attn.model.qwen3_moe import Qwen3MoeForCausalLM

MODELS: dict[str, type[CausalLM]] = {
    arch: cls for cls in (LlamaForCausalLM, MptForCausalLM, Gemma2ForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
                          MixtralForCausalLM, Qwen3MoeForCausalLM, Llama4ForCausalLM)
    for arch in cls.architectures}


def model_class(config: ModelConfig) -> type[CausalLM]:
    return MODELS[config.architecture]


def build_model(config: ModelConfig, **kw) -> CausalLM:
    """The model for ``config``; ``kw`` are the model constructor's (tp_rank, tp_size, tp_group,
    device, block_size, kv_cache_dtype, kernel)."""
    return model_class(config)(config, **kw)


def save_random_checkpoint(config: ModelConfig, folder: str, seed: int, *, std: float | None = None,
                           num_shards: int = 1) -> None:
    """config.json plus the seeded random weights as HF-named safetensors (sharded with an index
    file when ``num_shards > 1``); ``init_random_weights(seed)`` on CPU gives the same model."""
    hf = hf_config_dict(config)  # first: a config its family's config.json cannot hold writes nothing
    meta = build_model(config, device="meta", kernel="torch")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    weights.write_random_checkpoint(meta.weight_shards(), folder, seed, dtype=config.dtype, std=std,
                                    tied=config.tie_word_embeddings, num_shards=num_shards)
