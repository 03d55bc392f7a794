"""What the distributed layer adds to one decode step, TP=1: planner + object ref + actor call +
the device copy of the plan.

The same engine runs the same decode batch three ways -- in-process (no Ray), a classic Ray actor
call, and a Ray compiled graph -- on a deliberately tiny model, so that the step time is mostly
the machinery.  "added" is each path's step time minus the in-process one.

    python scripts/bench_step_overhead.py [--batch 64] [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

from ray_attn.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig  # noqa: E402
from ray_attn.engine import LLMEngine, SamplingParams  # noqa: E402


def tiny_config(compiled: bool, device: str) -> EngineConfig:
    model = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1,
                        dtype="bfloat16" if device == "cuda" else "float32")
    return EngineConfig(model=model, cache=CacheConfig(num_blocks=4096),
                        parallel=ParallelConfig(device=device, use_compiled_graph=compiled),
                        max_num_seqs=512, max_num_batched_tokens=16384)


def decode_step_times(engine: LLMEngine, batch: int, steps: int) -> dict:
    rng = np.random.default_rng(0)
    for _ in range(batch):
        engine.add_request(rng.integers(0, 256, 64).tolist(), SamplingParams(max_tokens=steps + 10))
    while any(not r.num_output_tokens for r in engine.requests.values()):
        engine.step()  # prefill
    plan_t, step_t = [], []
    orig = engine.planner.plan

    def timed_plan(s):
        t0 = time.perf_counter()
        p = orig(s)
        plan_t.append(time.perf_counter() - t0)
        return p

    engine.planner.plan = timed_plan
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        step_t.append(time.perf_counter() - t0)
    engine.planner.plan = orig
    for rid in list(engine.requests):
        engine.abort_request(rid)
    return {"step_us": statistics.median(step_t) * 1e6, "plan_us": statistics.median(plan_t) * 1e6,
            "step_p90_us": float(np.percentile(step_t, 90) * 1e6)}


def plan_copy_us(engine: LLMEngine, batch: int, dev) -> float:
    """The worker's copy of one decode plan's arrays to the device."""
    from ray_attn.planner import ScheduledRequest

    p = engine.planner
    reqs = [ScheduledRequest(f"copy-{i}", list(range(1, 40))) for i in range(batch)]
    plan = p.plan(reqs)
    t = bl.timeit(lambda: plan.attn.to_device(dev), iters=50)
    for r in reqs:
        p.free(r.req_id)
    return t * 1e6


def main(argv=None):
    from ray_attn.runtime import InProcessExecutor

    a = argparse.ArgumentParser()
    a.add_argument("--batch", type=int, default=64)
    a.add_argument("--steps", type=int, default=200)
    args = a.parse_args(argv)
    dev = bl.device()
    device = dev.type
    rows = []
    cfg = tiny_config(False, device)
    eng = LLMEngine(cfg, InProcessExecutor(cfg))
    base = decode_step_times(eng, args.batch, args.steps)
    copy_us = plan_copy_us(eng, args.batch, dev)
    rows.append(dict(path="in-process (no Ray)", **base, added_us=0.0))
    for compiled in (False, True):
        eng = LLMEngine(tiny_config(compiled, device))
        r = decode_step_times(eng, args.batch, args.steps)
        eng.shutdown()
        rows.append(dict(path="compiled graph" if compiled else "classic actor call", **r,
                         added_us=r["step_us"] - base["step_us"]))
    path = bl.save("bench_step_overhead", rows, batch=args.batch, steps=args.steps,
                   plan_device_copy_us=copy_us)
    bl.print_table(rows, ["path", "step_us", "step_p90_us", "plan_us", "added_us"],
                   f"decode step, batch {args.batch}, 1-layer model, TP=1")
    print(f"plan -> device copy: {copy_us:.1f} us;  wrote {path}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.barh([r["path"] for r in rows], [r["step_us"] / 1e3 for r in rows])
    ax.set_xlabel("median step time (ms)")
    ax.set_title(f"Step overhead, batch {args.batch}, TP=1 ({bl.machine().get('gpu') or 'CPU'})")
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
