#!/usr/bin/env python
"""How many requests the KV cache keeps resident, against the ideal its size allows, and where
the GPU's memory went (``device_info()['memory']``: the profile-step sizing of
``ray_attn/runtime/memory.py``).

The workload is the capacity note's: 256 prompts of 4096 random tokens, 128 output tokens each
(EOS ignored), all given at once; the engine steps until every one has finished.  Reported:

- the memory breakdown per rank (total, weights, peak activations, non-torch, graph reserve and
  the pool the capture took, KV bytes, blocks) and what the sizing before it would have taken
  (``memory_fraction`` of the memory free after the weights, allocator cache included);
- ``peak_running``: the most requests running at once (admitted, holding KV);
- ``ideal_requests = floor(kv_bytes / (tokens_per_request * kv_bytes_per_token))`` with
  ``tokens_per_request = input + output``, and the same in whole blocks;
- preemptions (recomputes) the run needed.

    python scripts/kv_capacity.py                          # GPU: Llama-3-8B shape, 256 x 4k
    python scripts/kv_capacity.py --preset tiny --device cpu --num-requests 8 --input-len 512
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def kv_bytes_per_token(engine) -> int:
    """K and V of one token, every layer, on one rank (the cache's own dtype)."""
    m, tp = engine.config.model, engine.config.parallel.tensor_parallel_size
    el = 1 if engine.config.cache.kv_cache_dtype.startswith("fp8") else {"float32": 4}.get(m.dtype, 2)
    return 2 * m.num_hidden_layers * max(m.num_key_value_heads // tp, 1) * m.head_size * el


def ideal_requests(kv_bytes: int, tokens_per_request: int, per_token: int, block_size: int) -> dict:
    """Requests of ``tokens_per_request`` tokens the cache holds at once: by bytes, and in whole
    blocks (a request's last block is whole however few tokens it holds)."""
    if tokens_per_request < 1 or per_token < 1 or block_size < 1:
        raise ValueError(f"tokens_per_request, per_token and block_size must be >= 1, got "
                         f"{tokens_per_request}, {per_token}, {block_size}")
    blocks = -(-tokens_per_request // block_size)
    return dict(ideal_requests=kv_bytes // (tokens_per_request * per_token),
                ideal_requests_in_blocks=kv_bytes // (blocks * block_size * per_token))


def measure_capacity(engine, num_requests: int, input_len: int, output_len: int, seed: int = 0,
                     disable_tqdm: bool = True) -> dict:
    """Run the workload on an idle engine; the figures of the module docstring."""
    from tqdm.auto import tqdm

    from ray_attn.request import SamplingParams

    if min(num_requests, input_len, output_len) < 1:
        raise ValueError(f"num_requests, input_len and output_len must be >= 1, got "
                         f"{num_requests}, {input_len}, {output_len}")
    cfg = engine.config
    rng = np.random.default_rng(seed)
    base = engine.stats.as_dict()
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    ids = [engine.add_request(rng.integers(0, cfg.model.vocab_size, input_len).tolist(), params)
           for _ in range(num_requests)]
    live, peak, bar = set(ids), 0, tqdm(total=num_requests, disable=disable_tqdm, desc="capacity")
    peak_blocks = 0
    while live:
        engine.step()
        peak = max(peak, len(engine.running))
        ps = engine.planner.stats()
        peak_blocks = max(peak_blocks, ps["num_used_blocks"])
        done = [i for i in live if engine.requests[i].finished]
        for i in done:
            engine.release(i)
        live.difference_update(done)
        bar.update(len(done))
    engine.flush()
    bar.close()
    elapsed = time.perf_counter() - t0
    per_token = kv_bytes_per_token(engine)
    infos = engine.executor.infos
    mem = [i.get("memory") for i in infos]
    num_blocks = engine.planner.pool.num_blocks
    bs = cfg.cache.block_size
    kv_bytes = min(m["kv_bytes"] for m in mem) if all(mem) else num_blocks * bs * per_token
    out = dict(num_requests=num_requests, input_len=input_len, output_len=output_len,
               tokens_per_request=input_len + output_len, kv_bytes_per_token=per_token,
               kv_cache_dtype=cfg.cache.kv_cache_dtype, tp=cfg.parallel.tensor_parallel_size,
               memory_fraction=cfg.cache.memory_fraction, max_num_seqs=cfg.max_num_seqs,
               max_num_batched_tokens=cfg.max_num_batched_tokens, num_blocks=num_blocks,
               block_size=bs, kv_bytes=kv_bytes, memory=mem, peak_running=peak,
               peak_used_blocks=peak_blocks, preemptions=engine.stats.preemptions - base["preemptions"],
               steps=engine.stats.steps - base["steps"], elapsed_s=elapsed)
    out.update(ideal_requests(kv_bytes, input_len + output_len, per_token, bs))
    out["resident_vs_ideal"] = peak / out["ideal_requests"] if out["ideal_requests"] else None
    if all(mem):  # what the sizing before the profile step would have given
        legacy = min(int(m["free_after_weights_bytes"] * cfg.cache.memory_fraction) for m in mem)
        out["legacy_kv_bytes"] = legacy
        out["legacy_ideal_requests"] = ideal_requests(legacy, input_len + output_len, per_token, bs)["ideal_requests"]
    return out


def print_capacity(r: dict) -> None:
    gb = 1e9
    for m in r["memory"]:
        if m:
            print(f"total {m['total_bytes'] / gb:.1f} GB x {m['memory_fraction']}: weights "
                  f"{m['weights_bytes'] / gb:.2f}, peak activations {m['peak_activation_bytes'] / gb:.2f}, "
                  f"non-torch {m['non_torch_bytes'] / gb:.2f}, graph reserve "
                  f"{m['graph_pool_reserve_bytes'] / gb:.2f} (capture took "
                  f"{(m['graph_pool_bytes'] or 0) / gb:.2f}), KV {m['kv_bytes'] / gb:.2f} GB = "
                  f"{m['num_blocks']} blocks; allocator cache before: {(m['allocator_cache_bytes'] or 0) / gb:.2f} GB")
    legacy = f" (the old sizing: {r['legacy_ideal_requests']})" if "legacy_ideal_requests" in r else ""
    print(f"{r['num_requests']} x ({r['input_len']} + {r['output_len']}): peak running {r['peak_running']}, "
          f"ideal {r['ideal_requests']}{legacy}, preemptions {r['preemptions']}, {r['elapsed_s']:.1f} s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default=None, help="model preset (default: llama-3-8b on GPU, tiny on CPU)")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    p.add_argument("--num-blocks", type=int, default=None, help="fix the cache (default: sized from memory)")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--input-len", type=int, default=4096)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--json", default=str(RESULTS / "kv_capacity.json"))
    args = p.parse_args(argv)
    import torch

    from ray_attn.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
    from ray_attn.engine import LLMEngine

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    preset = args.preset or ("llama-3-8b" if device == "cuda" else "tiny")
    for name in ("tp", "num_requests", "input_len", "output_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    cfg = EngineConfig(model=ModelConfig.from_name(preset),
                       cache=CacheConfig(num_blocks=args.num_blocks, kv_cache_dtype=args.kv_cache_dtype),
                       parallel=ParallelConfig(tensor_parallel_size=args.tp, device=device,
                                               use_compiled_graph=device == "cuda"),
                       max_num_seqs=256, max_num_batched_tokens=8192)
    engine = LLMEngine(cfg)
    try:
        r = measure_capacity(engine, args.num_requests, args.input_len, args.output_len)
    finally:
        engine.shutdown()
    r.update(preset=preset, device=device)
    print_capacity(r)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(r, indent=1, default=float) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
