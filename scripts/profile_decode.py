"""Where a decode step's time goes: engine wall time vs the GPU time of its replayed CUDA graph,
and the kernels that fill that GPU time (torch profiler).  In process, no Ray: what remains
between the two figures is the engine, the planner, staging and sampling.

Per point it also counts the kernels of one step by kind (GEMM/GEMV, attention, norm, RoPE, ...):
how many, their GPU time and the microseconds per kernel -- a step that is a chain of small
kernels shows as many kernels of a few microseconds each -- and sets the replay against the
weight-read roofline of the step (``servebench/roofline.py``: the bytes a decode step reads over
the copy rate measured on the device).  ``--presets`` runs several models in one call (issue 39's
"measure first": llama-3-8b bf16 and FP8, qwen3-30b-a3b, llama-4-scout cut to ``--scout-layers``),
``--json`` writes every table.

    python scripts/profile_decode.py                  # GPU: Llama-3-8B shape
    python scripts/profile_decode.py --points 64x1024 --top 20
    python scripts/profile_decode.py --model qwen3-30b-a3b --points 1x1024 --top 30
    python scripts/profile_decode.py --presets llama-3-8b,llama-3-8b:fp8,qwen3-30b-a3b,llama-4-scout \
        --points 1x1024 --json benchmarks/results/profile_decode_kernels.json
    python scripts/profile_decode.py --presets llama-3-8b,llama-3-8b:fp8 --points "" --prefill 8192

``--prefill N`` also profiles one eager prefill step of N tokens (prompts of ``--prefill-len``,
as the offline workload's chunks): its wall time against the FLOPs of its prompts over the GEMM
rate measured at the model's shapes (FP8's ``_scaled_mm`` rate for FP8 presets), and its kernels
by kind -- where an offline run's prefill time goes.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402
from servebench import roofline as rl  # noqa: E402

from ray_attn.config import MODEL_PRESETS, CacheConfig, EngineConfig, ModelConfig, ParallelConfig  # noqa: E402
from ray_attn.engine import LLMEngine, SamplingParams  # noqa: E402
from ray_attn.runtime import InProcessExecutor  # noqa: E402


def timed(fn, acc: list):
    def wrapper(*a):
        t0 = time.perf_counter()
        r = fn(*a)
        acc[0] += time.perf_counter() - t0
        return r
    return wrapper


def timeline(g, replays: int) -> str:
    """Replays back to back under the profiler: the span from the first kernel's start to the
    last one's end against the time some kernel runs, and the longest idle gaps with the kernel
    before each -- where a graph's wall time goes that per-kernel sums do not show."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
    ks = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start)
    span = ks[-1][1] - ks[0][0]
    busy, gaps, end, prev = 0.0, [], ks[0][0], ""
    for s, e, name in ks:
        if s > end:
            gaps.append((s - end, prev))
        busy += max(0.0, e - max(s, end))
        if e > end:
            end, prev = e, name
    gaps.sort(reverse=True)
    out = (f"\n  timeline over {replays} replays: span {span / replays / 1e3:.2f} ms a replay, kernels busy "
           f"{busy / replays / 1e3:.2f} ms, idle {sum(x for x, _ in gaps) / replays / 1e3:.2f} ms in {len(gaps)} gaps")
    for x, name in gaps[:5]:
        out += f"\n    gap {x:8.1f} us after {name[:90]}"
    return out


# Kernel kinds, by name (the first pattern that matches): what a fused decoder would merge.
KINDS = [("lora", r"_shrink_kernel|_expand_kernel|lora"), ("all-reduce", r"nccl|allreduce|all_reduce"), ("attention", r"flash|fmha|attn|paged"),
         ("moe", r"moe|grouped|expert|_route"), ("fp8 quantize", r"quant|scaled_fp8|fp8_rows"),
         ("norm", r"rms|norm"), ("rope", r"rope|rotary"), ("activation", r"silu|gelu|swiglu|act_and_mul"),
         ("gemm/gemv", r"gemm|gemv|sm90|xmma|cutlass|nvjet|cublas|matmul|skinny|_mm_|linear|splitk"),
         ("sampling", r"argmax|sample|topk|softmax|gumbel|logits"),
         ("copy/elementwise", r"copy|elementwise|fill|index|cat|memcpy|memset|reduce|vectorized")]


def kernel_kinds(key_averages) -> list[dict]:
    """One step's kernels by kind: count, GPU microseconds, microseconds per kernel, share."""
    rows: dict[str, dict] = {}
    for e in key_averages:
        kind = next((k for k, pat in KINDS if re.search(pat, e.key, re.I)), "other")
        r = rows.setdefault(kind, dict(kind=kind, kernels=0, us=0.0))
        r["kernels"] += e.count
        r["us"] += e.device_time_total
    total = sum(r["us"] for r in rows.values()) or 1.0
    for r in rows.values():
        r["us_per_kernel"] = r["us"] / max(r["kernels"], 1)
        r["share"] = r["us"] / total
    return sorted(rows.values(), key=lambda r: -r["us"])


def kernel_table(rec: dict, run, top: int) -> str:
    """Profile one ``run()`` on the GPU: its kernels' count, GPU time, kinds and the ``top``
    longest go into ``rec``; returns them as text."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    ka = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    rec["kernels"] = sum(e.count for e in ka)
    rec["kernel_ms"] = sum(e.device_time_total for e in ka) / 1e3
    rec["kinds"] = kernel_kinds(ka)
    rec["top"] = [dict(name=e.key[:120], count=e.count, us=e.device_time_total) for e in ka[:top]]
    line = f"\n  {rec['kernels']} kernels, {rec['kernel_ms']:.2f} ms:"
    line += "\n  kind               kernels      us  us/kernel  share"
    for r in rec["kinds"]:
        line += f"\n  {r['kind']:<18} {r['kernels']:7d} {r['us']:8.1f} {r['us_per_kernel']:9.2f} {r['share']:6.1%}"
    for e in ka[:top]:
        line += f"\n  {e.device_time_total / 1e3:7.3f} ms x{e.count:4d}  {e.key[:100]}"
    return line


def gemm_rate(cfg: EngineConfig, rates: dict, dev: torch.device) -> float:
    """FLOP/s of the model's own GEMM shapes on this device (FP8's ``_scaled_mm`` rate for FP8
    weights), measured once per model and kept in ``rates``."""
    from servebench import device_rates

    m = cfg.model
    key = (m.hidden_size, m.intermediate_size, m.num_attention_heads, m.num_key_value_heads)
    if key not in rates:
        rates[key] = device_rates.measure(dev.type, rl.gemm_shapes(m), 1 << 24, "bfloat16" if dev.type == "cuda"
                                          else "float32")
    r = rates[key]
    return r.get("fp8_gemm_flops", r["gemm_flops"]) if m.quantization == "fp8" else r["gemm_flops"]


def profile_prefill(args, spec, cfg, eng, rates: dict, dev: torch.device) -> dict:
    """One step that prefills ``args.prefill`` tokens of fresh prompts (no prefix hits): wall time,
    the prompts' FLOPs over the GEMM rate, and (GPU) the kernels by kind."""
    m, gpu = cfg.model, dev.type == "cuda"
    L = min(args.prefill_len, args.prefill, m.max_position_embeddings - 1)
    n = max(args.prefill // L, 1)
    if n * L > cfg.max_num_batched_tokens:
        raise SystemExit(f"--prefill {n * L} exceeds the engine's max_num_batched_tokens={cfg.max_num_batched_tokens}")
    rng = np.random.default_rng(1)
    costs = rl.ModelCosts.from_config(m, 1, cfg.cache.kv_cache_dtype)

    def step(profiled: bool = False) -> tuple[float, str]:
        """One prefill step of fresh prompts: its wall time, and (``profiled``) its kernel table."""
        ids = [eng.add_request(rng.integers(0, m.vocab_size, L).tolist(), SamplingParams(max_tokens=1))
               for _ in range(n)]
        if gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        table = ""
        if profiled:
            table = kernel_table(rec, eng.step, args.top)
        else:
            eng.step()
        if gpu:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        bl.end_requests(eng, ids)
        return wall, table

    rec = dict(preset=spec, prefill_tokens=n * L, prompt_len=L)
    walls = sorted(step()[0] for _ in range(3))  # the first warms cuBLAS and the allocator
    rec["step_ms"] = walls[1] * 1e3
    rec["roofline_ms"] = n * rl.prefill_flops(costs, L) / gemm_rate(cfg, rates, dev) * 1e3
    rec["frac_of_roofline"] = rec["roofline_ms"] / rec["step_ms"]
    line = (f"{spec} prefill {n} x {L} tokens: step {rec['step_ms']:.2f} ms; GEMM-rate roofline "
            f"{rec['roofline_ms']:.2f} ms ({rec['frac_of_roofline']:.1%} of it)")
    if gpu:
        line += step(profiled=True)[1]
    print(line, flush=True)
    return rec


def preset_config(spec: str, gpu: bool, block_size: int, scout_layers: int, quantization=None,
                  memory_fraction: float = 0.5, batch_invariant: bool = False) -> EngineConfig:
    """``name[:quantization]`` as the engine config every point of it runs."""
    name, _, quant = spec.partition(":")
    mc = ModelConfig(**MODEL_PRESETS[name], quantization=quant or quantization)
    if name == "llama-4-scout":  # 48 layers do not fit one GPU
        L = scout_layers
        mc = mc.model_copy(update=dict(num_hidden_layers=L, layer_types=mc.layer_kinds()[:L],
                                       moe_layers=[i for i in mc.moe_layer_ids if i < L] if mc.moe_layers else None,
                                       no_rope_layers=(mc.no_rope_layers or [1] * 48)[:L]))
        mc = ModelConfig(**mc.model_dump())
    return EngineConfig(model=mc, cache=CacheConfig(block_size=block_size, memory_fraction=memory_fraction,
                                                    num_blocks=None if gpu else 512),
                        parallel=ParallelConfig(device="cuda" if gpu else "cpu", batch_invariant=batch_invariant),
                        max_num_seqs=256, max_num_batched_tokens=8192 if gpu else 512,
                        async_scheduling=False)  # timed synchronously first, then async


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--points", default="1x1024,64x1024,256x1024")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--block-size", type=int, default=16, help="KV page size (FA3 takes any)")
    p.add_argument("--model", default=None, help="a MODEL_PRESETS name (default llama-3-8b on a GPU, tiny on CPU)")
    p.add_argument("--quantization", default=None, help="e.g. fp8: weights quantized to e4m3 at load")
    p.add_argument("--no-aot", action="store_true", help="FA3 without its ahead-of-time scheduler plan")
    p.add_argument("--presets", default=None, help="comma-separated name[:quantization] (overrides --model)")
    p.add_argument("--scout-layers", type=int, default=12, help="llama-4-scout's layers on one GPU")
    p.add_argument("--memory-fraction", type=float, default=0.5,
                   help="the GPU memory the engine may take (Qwen3-30B-A3B's 57 GB of weights need ~0.9 on 80 GB)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="ParallelConfig.batch_invariant: what the mode costs (dense unquantized presets)")
    p.add_argument("--prefill", type=int, default=0, metavar="N",
                   help="also profile one prefill step of N tokens (0: none)")
    p.add_argument("--prefill-len", type=int, default=1024, help="the prefill step's prompt length")
    p.add_argument("--json", default=None, help="write every point's kernel table and roofline here")
    p.add_argument("--timeline", type=int, default=0, metavar="N",
                   help="also profile N back-to-back replays: span vs busy time, longest gaps")
    args = p.parse_args(argv)
    if args.no_aot:
        from ray_attn.backend.kernels import FlashAttn3Kernel

        FlashAttn3Kernel.uses_scheduler_metadata = False  # in process: this engine's kernel
    gpu = torch.cuda.is_available()
    specs = (args.presets or args.model or ("llama-3-8b" if gpu else "tiny")).split(",")
    dev = torch.device("cuda" if gpu else "cpu")
    copy_Bps = bl.copy_bandwidth(1 << 30 if gpu else 1 << 24, dev)
    rates = {}
    results = []

    def save() -> None:  # after each preset: a call that runs out of time keeps what finished
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(dict(machine=bl.machine(), copy_Bps=copy_Bps, points=results),
                                                  indent=1))

    for spec in specs:
        t0 = time.perf_counter()
        cfg = preset_config(spec, gpu, args.block_size, args.scout_layers, args.quantization, args.memory_fraction,
                            args.batch_invariant)
        ex = InProcessExecutor(cfg)
        eng = LLMEngine(cfg, ex)
        try:
            results += profile_points(args, spec, cfg, eng, ex, gpu, copy_Bps)
            if args.prefill:
                results.append(profile_prefill(args, spec, cfg, eng, rates, dev))
        finally:
            eng.shutdown()
            del eng, ex
            if gpu:
                torch.cuda.empty_cache()
        save()
        print(f"{spec}: done in {time.perf_counter() - t0:.0f} s", flush=True)


def profile_points(args, spec, cfg, eng, ex, gpu, copy_Bps) -> list[dict]:
    m = cfg.model
    costs = rl.ModelCosts.from_config(m, 1, cfg.cache.kv_cache_dtype)
    rng = np.random.default_rng(0)
    out = []
    for point in filter(None, args.points.split(",")):
        B, C = (int(x) for x in point.split("x"))
        C = C if gpu else min(C, 128)
        ids = bl.start_decoding(eng, [rng.integers(0, m.vocab_size, C).tolist() for _ in range(B)],
                                [SamplingParams(max_tokens=m.max_position_embeddings - C - 1)] * B)
        for _ in range(3):
            eng.step()
        plan_t, work_t = [0.0], [0.0]
        orig = eng._plan, ex.step
        eng._plan, ex.step = timed(eng._plan, plan_t), timed(ex.step, work_t)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            eng.step()
        wall = (time.perf_counter() - t0) / args.steps
        eng._plan, ex.step = orig
        eng.set_async_scheduling(True)  # the same steps, planned while the previous one runs
        t0 = time.perf_counter()
        for _ in range(args.steps):
            eng.step()
        wall_async = (time.perf_counter() - t0) / args.steps
        eng.set_async_scheduling(False)
        # weights once plus every row's KV (batch B decode at context C): the step's memory bound
        step_bytes = costs.weight_bytes + B * (C + 4) * costs.kv_bytes_per_token
        if costs.num_experts and B > 1:  # more rows hit more experts: up to all of them
            hit = min(costs.num_experts, B * costs.top_k)
            step_bytes += (hit - costs.top_k) * costs.expert_bytes / max(costs.top_k, 1)
        roof_ms = step_bytes / copy_Bps * 1e3
        rec = dict(preset=spec, batch=B, ctx=C, step_ms=wall * 1e3, async_step_ms=wall_async * 1e3,
                   planner_ms=plan_t[0] / args.steps * 1e3, worker_ms=work_t[0] / args.steps * 1e3,
                   roofline_ms=roof_ms)
        line = (f"{spec} batch {B} x ctx {C}: step {wall * 1e3:.2f} ms (planner {rec['planner_ms']:.2f}, "
                f"worker {rec['worker_ms']:.2f}); async scheduling {wall_async * 1e3:.2f} ms; "
                f"weight+KV roofline {roof_ms:.2f} ms")
        graphs = ex.worker.graphs
        if graphs is not None:
            g = graphs.graphs[graphs.padded_size(B), False]
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(10):
                g.replay()
            e1.record()
            e1.synchronize()
            rec["replay_ms"] = e0.elapsed_time(e1) / 10
            rec["replay_over_roofline"] = rec["replay_ms"] / roof_ms
            line += f"; graph replay on the GPU {rec['replay_ms']:.2f} ms ({rec['replay_over_roofline']:.2f}x roofline)"
            line += kernel_table(rec, g.replay, args.top)
            if args.timeline:
                try:
                    line += timeline(g, args.timeline)
                except Exception as e:  # a profiler without this event API: say so, keep the rest
                    line += f"\n  timeline unavailable: {type(e).__name__}: {e}"
        print(line, flush=True)
        out.append(rec)
        bl.end_requests(eng, ids)
    return out


if __name__ == "__main__":
    main()
