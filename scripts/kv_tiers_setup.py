"""``bench_kv_tiers.py``'s set-up: its parts, the CPU stand-in model, the per-device workload
defaults, and the engines, Ray and the shared store each part starts and stops."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from multiturn import counters  # noqa: E402

from ray_attn.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig  # noqa: E402
from ray_attn.engine import LLMEngine, SamplingParams  # noqa: E402


PARTS = ("host", "share", "copy", "breakeven")
# The CPU stand-in: wide enough that prefill costs something next to a step's fixed cost.
CPU_MODEL = dict(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096, seed=3)
DEFAULTS = {  # per device: users, turns, doc_tokens, question_tokens, answer_tokens, concurrency
    "cpu": dict(users=16, turns=3, doc_tokens=256, question_tokens=16, answer_tokens=16, concurrency=4),
    "cuda": dict(users=200, turns=8, doc_tokens=8192, question_tokens=64, answer_tokens=128, concurrency=32),
}


# ---------------------------------------------------------------------------- set-up
def model_config(a) -> ModelConfig:
    if a.model == "cpu":
        return ModelConfig(**CPU_MODEL)
    return ModelConfig.from_name(a.model, **({} if a.device == "cuda" else {"dtype": "float32"}))


def describe(a) -> str:
    m = model_config(a)
    name = "random weights" if a.model == "cpu" else f"{a.model} shape, random weights"
    return (f"{m.num_hidden_layers} layers x {m.hidden_size} wide, {m.num_key_value_heads} KV heads of "
            f"{m.head_size}, {m.dtype} ({name}), block {a.block_size}, TP={a.tp}")


def block_bytes(a) -> int:
    """One block of every layer, one rank's KV heads: what the tiers copy per block and rank."""
    m = model_config(a)
    item = {"float32": 4, "bfloat16": 2, "float16": 2}[m.dtype]
    return m.num_hidden_layers * 2 * a.block_size * max(m.num_key_value_heads // a.tp, 1) * m.head_size * item


def engine_config(a, num_blocks: int, host_gib: float = 0.0, sharing: bool = False,
                  min_share_tokens: int | None = None, max_share_tokens: int | None = None) -> EngineConfig:
    cache = dict(block_size=a.block_size, num_blocks=num_blocks, host_cache_gib=host_gib, kv_sharing=sharing,
                 kv_store_gib=a.store_gib, kv_share_max_tokens=max_share_tokens)
    if min_share_tokens is not None:
        cache["kv_share_min_tokens"] = min_share_tokens
    return EngineConfig(model=model_config(a), cache=CacheConfig(**cache),
                        parallel=ParallelConfig(tensor_parallel_size=a.tp, device=a.device, num_cpus_per_worker=1),
                        max_num_seqs=max(64, a.concurrency), max_num_batched_tokens=a.max_batched_tokens)


def make_engine(a, cfg: EngineConfig, cluster: bool = False) -> LLMEngine:
    if cluster:
        from ray_attn.runtime import AttentionCluster

        executor = AttentionCluster(cfg)
    else:
        from ray_attn.runtime import InProcessExecutor

        executor = InProcessExecutor(cfg)
    if a.device == "cpu":  # the rank set its own thread count; a loaded box runs far better on 1
        torch.set_num_threads(a.threads)
    eng = LLMEngine(cfg, executor)
    rng = np.random.default_rng(12345)  # warm-up, shorter than a block: nothing cached or published
    eng.generate([rng.integers(0, cfg.model.vocab_size, a.block_size // 2).tolist()], SamplingParams(max_tokens=2))
    eng.baseline = counters(eng)
    return eng


def capped_gib(nbytes: float, what: str) -> float:
    """``nbytes`` in GiB, at most 40% of this host's memory (the host tier is allocated up front)."""
    import os

    cap = 0.4 * os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if nbytes > cap:
        print(f"note: the {what} would need {nbytes / (1 << 30):.1f} GiB for the whole working set; capped at "
              f"{cap / (1 << 30):.1f} GiB (40% of this host's memory)")
    return min(nbytes, cap) / (1 << 30)


def start_ray(a) -> None:
    """A Ray of our own (the stores are actors), never another cluster on this machine."""
    import ray

    from ray_attn.runtime.cluster import init_local_ray

    if not ray.is_initialized():
        init_local_ray(num_cpus=max(4, 2 * a.tp), include_dashboard=False, log_to_driver=False)


def clear_store(a) -> None:
    import ray

    from ray_attn.runtime.kv_store import node_store

    ray.get(node_store(capacity_bytes=int(a.store_gib * (1 << 30))).clear.remote())


def free(*engines) -> None:
    for e in engines:
        e.shutdown()
    gc.collect()
