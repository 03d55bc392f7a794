"""Where a decode step's time goes: engine wall time vs the GPU time of its replayed CUDA graph,
and the kernels that fill that GPU time (torch profiler).  In process, no Ray: what remains
between the two figures is the engine, the planner, staging and sampling.

    python scripts/profile_decode.py                  # GPU: Llama-3-8B shape
    python scripts/profile_decode.py --points 64x1024 --top 20
    python scripts/profile_decode.py --model qwen3-30b-a3b --points 1x1024 --top 30
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

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


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--points", default="1x1024,64x1024,256x1024")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--block-size", type=int, default=16, help="KV page size (FA3 takes any)")
    p.add_argument("--model", default=None, help="a MODEL_PRESETS name (default llama-3-8b on a GPU, tiny on CPU)")
    p.add_argument("--quantization", default=None, help="e.g. fp8: weights quantized to e4m3 at load")
    p.add_argument("--no-aot", action="store_true", help="FA3 without its ahead-of-time scheduler plan")
    p.add_argument("--timeline", type=int, default=0, metavar="N",
                   help="also profile N back-to-back replays: span vs busy time, longest gaps")
    args = p.parse_args(argv)
    if args.no_aot:
        from ray_attn.backend.kernels import FlashAttn3Kernel

        FlashAttn3Kernel.uses_scheduler_metadata = False  # in process: this engine's kernel
    gpu = torch.cuda.is_available()
    m = MODEL_PRESETS[args.model or ("llama-3-8b" if gpu else "tiny")]
    cfg = EngineConfig(model=ModelConfig(**m, quantization=args.quantization), cache=CacheConfig(block_size=args.block_size, memory_fraction=0.5,
                                                                 num_blocks=None if gpu else 512),
                       parallel=ParallelConfig(device="cuda" if gpu else "cpu"),
                       max_num_seqs=256, max_num_batched_tokens=8192 if gpu else 512,
                       async_scheduling=False)  # timed synchronously first, then async
    ex = InProcessExecutor(cfg)
    eng = LLMEngine(cfg, ex)
    rng = np.random.default_rng(0)
    for point in args.points.split(","):
        B, C = (int(x) for x in point.split("x"))
        C = C if gpu else min(C, 128)
        ids = bl.start_decoding(eng, [rng.integers(0, m["vocab_size"], C).tolist() for _ in range(B)],
                                [SamplingParams(max_tokens=m["max_position_embeddings"] - C - 1)] * B)
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
        line = (f"batch {B} x ctx {C}: step {wall * 1e3:.2f} ms (planner {plan_t[0] / args.steps * 1e3:.2f}, "
                f"worker {work_t[0] / args.steps * 1e3:.2f}); async scheduling {wall_async * 1e3:.2f} ms")
        graphs = ex.worker.graphs
        if graphs is not None:
            g = graphs.graphs[graphs.padded_size(B), False]
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(10):
                g.replay()
            e1.record()
            e1.synchronize()
            line += f"; graph replay on the GPU {e0.elapsed_time(e1) / 10:.2f} ms"
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                g.replay()
                torch.cuda.synchronize()
            ka = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
            line += f"\n  {sum(e.count for e in ka)} kernels, {sum(e.device_time_total for e in ka) / 1e3:.2f} ms:"
            for e in ka[:args.top]:
                line += f"\n  {e.device_time_total / 1e3:7.3f} ms x{e.count:4d}  {e.key[:100]}"
            if args.timeline:
                try:
                    line += timeline(g, args.timeline)
                except Exception as e:  # a profiler without this event API: say so, keep the rest
                    line += f"\n  timeline unavailable: {type(e).__name__}: {e}"
        print(line, flush=True)
        bl.end_requests(eng, ids)


if __name__ == "__main__":
    main()
