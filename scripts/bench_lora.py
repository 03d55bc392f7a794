"""Multi-LoRA cost: decode step time with adapters against the base model, on one engine.

Issue 41's goals, on an H200 with the Llama-3-8B shape (random bf16 weights), rank 16 on all seven
target modules (q/k/v/o, gate/up/down):
  * batch 1 under an adapter: ITL <= 1.10x the base's;
  * batch 64 over 8 distinct adapters: step time <= 1.15x the base's (decode throughput >= 0.87x).
Each case runs the same prompts through the same engine (its adapters in max_loras=8 slots, CUDA
graphs on where the device has them), times ``engine.step()`` over the steady decode steps, and
reports the median; the adapters are written in PEFT's format (random A and B) into a temp folder.
``--preset tiny --device cpu`` runs it in seconds (its test); its numbers mean nothing.
On CUDA the JSON also holds the kernel table of one batch-1 decode step with and without the
adapter (``kernels``: count, GPU microseconds and share by kind, ``profile_decode.KINDS``): what
the adapter adds, kernel by kernel.

    python scripts/bench_lora.py                       # H200: llama-3-8b, bf16
    python scripts/bench_lora.py --preset tiny --device cpu --steps 4 --batch 4 --adapters 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from ray_attn.config import MODEL_PRESETS, CacheConfig, EngineConfig, ModelConfig, ParallelConfig  # noqa: E402
from ray_attn.lora import TARGET_MODULES, LoRAConfig, LoRARequest  # noqa: E402
from ray_attn.lora.peft_format import base_shapes  # noqa: E402


def write_adapter(folder: str, model: ModelConfig, rank: int, seed: int) -> str:
    """A PEFT-format adapter of ``rank`` on every target module of every layer (random A, B)."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(model.num_hidden_layers):
        for name, (out, inp) in base_shapes(model).items():
            block = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{i}.{block}.{name}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, inp, generator=g) * inp ** -0.5).to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(out, rank, generator=g) * 0.01).to(torch.bfloat16)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGET_MODULES),
                   "bias": "none"}, f)
    return folder


def decode_step_times(engine, prompts, loras, max_tokens: int, skip: int) -> list[float]:
    """Seconds of each decode step of one batch (the first ``skip`` -- prefill, warm-up -- left out)."""
    from ray_attn.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for p, lr in zip(prompts, loras):
        engine.add_request(p, params, lora_request=lr)
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        if engine.device_sync is not None:
            engine.device_sync()
        times.append(time.perf_counter() - t0)
    return times[skip:-2] or times[-1:]


def kernel_table(engine, prompt, lora, tokens: int = 12) -> dict:
    """One steady batch-1 decode step under the torch profiler: its kernels by kind."""
    from torch.profiler import ProfilerActivity, profile

    import profile_decode as pd
    from ray_attn.engine import SamplingParams

    engine.add_request(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True), lora_request=lora)
    for _ in range(4):  # prefill and the first decode steps
        engine.step()
    engine.device_sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.step()
        engine.device_sync()
    while engine.has_unfinished_requests():
        engine.step()
    ka = prof.key_averages()
    kinds = pd.kernel_kinds(ka)
    return dict(kernels=sum(r["kernels"] for r in kinds), us=round(sum(r["us"] for r in kinds), 1),
                kinds=[{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()} for r in kinds])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-3-8b", choices=sorted(MODEL_PRESETS))
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--steps", type=int, default=64, help="decode tokens per request")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--out", default=None, help="write the JSON here too")
    args = ap.parse_args(argv)
    from ray_attn.engine import LLMEngine
    from ray_attn.runtime import InProcessExecutor

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    model = ModelConfig(**(MODEL_PRESETS[args.preset] | {"dtype": "bfloat16" if cuda else "float32"}))
    cfg = EngineConfig(model=model, cache=CacheConfig(num_blocks=None if cuda else 256),
                       parallel=ParallelConfig(device="cuda" if cuda else "cpu", kernel="auto" if cuda else "torch"),
                       lora_config=LoRAConfig(max_loras=args.adapters, max_lora_rank=args.rank),
                       max_num_seqs=max(args.batch, 1), max_num_batched_tokens=max(2048, args.batch * args.prompt_len))
    engine = LLMEngine(cfg, InProcessExecutor(cfg))
    engine.device_sync = torch.cuda.synchronize if cuda else None
    with tempfile.TemporaryDirectory() as tmp:
        loras = [LoRARequest(f"a{i}", i + 1, write_adapter(f"{tmp}/a{i}", model, args.rank, i))
                 for i in range(args.adapters)]
        g = torch.Generator().manual_seed(0)
        prompts = lambda n: [torch.randint(0, model.vocab_size, (args.prompt_len,), generator=g).tolist()  # noqa: E731
                             for _ in range(n)]
        skip = 3
        run = lambda n, lr: statistics.median(decode_step_times(engine, prompts(n), lr, args.steps, skip))  # noqa: E731
        run(1, [loras[0]])  # warm-up: loads the first adapter, compiles kernels
        b1_base, b1_lora = run(1, [None]), run(1, [loras[0]])
        mixed = [loras[i % args.adapters] for i in range(args.batch)]
        run(args.batch, mixed)  # every adapter into its slot first
        bn_base, bn_lora = run(args.batch, [None] * args.batch), run(args.batch, mixed)
        tables = {name: kernel_table(engine, prompts(1)[0], lr) for name, lr in (("base", None), ("lora", loras[0]))} \
            if cuda else None
    info = engine.executor.infos[0]
    out = {"preset": args.preset, "device": info.get("name"), "kernel": info.get("kernel"),
           "cuda_graphs": info.get("cuda_graphs"), "rank": args.rank, "targets": len(TARGET_MODULES),
           "batch1_itl_ms": {"base": round(b1_base * 1e3, 3), "lora": round(b1_lora * 1e3, 3),
                             "ratio": round(b1_lora / b1_base, 3), "goal": 1.10},
           f"batch{args.batch}_over_{args.adapters}_step_ms": {
               "base": round(bn_base * 1e3, 3), "lora": round(bn_lora * 1e3, 3),
               "ratio": round(bn_lora / bn_base, 3), "goal": 1.15,
               "throughput_ratio": round(bn_base / bn_lora, 3), "throughput_goal": 0.87}}
    if tables:
        out["batch1_kernels"] = tables
    print(json.dumps({k: v for k, v in out.items() if k != "batch1_kernels"}))
    for name, t in (tables or {}).items():
        print(f"batch-1 decode step, {name}: {t['kernels']} kernels, {t['us'] / 1e3:.2f} ms of GPU time")
        for r in t["kinds"]:
            print(f"  {r['kind']:<18} {r['kernels']:5d} {r['us']:9.1f} us {r['us_per_kernel']:7.2f} us/kernel {r['share']:6.1%}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
