"""A tiny random HF Llama and PEFT adapters on it, written by ``peft`` itself into a tmp folder;
and the HF peft model's logits, the reference every LoRA test is held to."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ray_attn.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from ray_attn.lora import LoRAConfig
from ray_attn.model import save_random_checkpoint

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (name, targets, r, lora_alpha, use_rslora): together they adapt every target module, at
# different ranks (one below the fused parts' others), scalings and a partial q/k/v set.
ADAPTERS = [("attn", ["q_proj", "k_proj", "v_proj", "o_proj"], 8, 16, False),
            ("mlp", ["gate_proj", "up_proj", "down_proj"], 4, 8, True),
            ("all", ALL, 16, 24, False),
            ("qv", ["q_proj", "v_proj"], 2, 4, False)]


def tiny_model(**kw) -> ModelConfig:
    base = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256)
    return ModelConfig(**(base | kw))


def write_base(folder, config: ModelConfig | None = None, seed: int = 1) -> str:
    save_random_checkpoint(config or tiny_model(), str(folder), seed=seed)
    return str(folder)


def hf_base(base: str, dtype=torch.float32):
    return transformers.LlamaForCausalLM.from_pretrained(base, dtype=dtype, attn_implementation="eager").eval()


def write_adapter(base: str, folder, targets, r: int, alpha: float, rslora: bool = False, seed: int = 0) -> str:
    """An adapter as peft writes it, with random (not zero) B: ``init_lora_weights=False``."""
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora,
                          init_lora_weights=False, lora_dropout=0.0)
    model = peft.get_peft_model(hf_base(base), cfg)
    with torch.no_grad():  # nn.Linear's init is small for B; scale it so the adapter matters
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(2.0)
    model.save_pretrained(str(folder))
    return str(folder)


def peft_model(base: str, adapter: str | None, dtype=torch.float32, merged: bool = False):
    model = hf_base(base, dtype)
    if adapter is None:
        return model
    model = peft.PeftModel.from_pretrained(model, adapter).eval()
    return model.merge_and_unload() if merged else model


def hf_logits(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor(tokens)[None]).logits[0].float()


def engine_config(base: str, tp: int = 1, max_loras: int = 2, max_lora_rank: int = 16, **kw) -> EngineConfig:
    return EngineConfig(checkpoint=base, cache=CacheConfig(num_blocks=64),
                        parallel=ParallelConfig(tensor_parallel_size=tp, device="cpu", kernel="torch",
                                                num_cpus_per_worker=1),
                        lora_config=LoRAConfig(max_loras=max_loras, max_lora_rank=max_lora_rank,
                                               max_cpu_loras=kw.pop("max_cpu_loras", None)),
                        max_num_batched_tokens=kw.pop("max_num_batched_tokens", 128), max_num_seqs=16, **kw)


def prompts(n: int, vocab: int = 96, seed: int = 5) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, vocab, 20).tolist()  # a shared prefix: prefix-cache hits across adapters
    return [shared + rng.integers(0, vocab, int(rng.integers(3, 30))).tolist() for _ in range(n)]


@pytest.fixture(scope="package")
def lora_models(tmp_path_factory):
    """The base checkpoint and every adapter of ``ADAPTERS``, by name."""
    root = tmp_path_factory.mktemp("lora")
    base = write_base(root / "base")
    adapters = {name: write_adapter(base, root / name, t, r, a, rs, seed=i)
                for i, (name, t, r, a, rs) in enumerate(ADAPTERS)}
    return base, adapters
