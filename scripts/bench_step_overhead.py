"""What the distributed layer adds to one decode step, TP=1: planner + object ref + actor call +
the device copy of the plan.

The same engine runs the same decode batch three ways -- in-process (no Ray), a classic Ray actor
call, and a Ray compiled graph -- on a deliberately tiny model, so that the step time is mostly
the machinery.  "added" is each path's step time minus the in-process one.

    python scripts/bench_step_overhead.py [--batch 64] [--steps 100] [--rounds 3] [--model stub|tiny|8b]
        [--async-scheduling off|on|both]

Each path runs synchronously and with async scheduling (``--async-scheduling both``): async
plans and sends step N+1 while step N runs, so what the machinery costs is hidden behind the
GPU's work whenever that work takes longer -- which it does not on the tiny model, where the
step *is* the machinery.  ``--model 8b`` (GPU) runs the Llama-3-8B shape, where a decode step
is milliseconds of GPU work: there "added" is what a real deployment pays per step.

On CPU the torch attention kernel of even the tiny model takes ~20 ms a step, which buries the
sub-millisecond machinery in noise, so there the default ``--model stub`` swaps the model for one
that returns zeros: the step is then planner + message + actor call + plan copy + sampling.
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
from plotting import pyplot  # noqa: E402

from ray_attn.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig  # noqa: E402
from ray_attn.engine import LLMEngine, SamplingParams  # noqa: E402


class StubModel:
    """Zero logits of the right shape, at no cost: what is left of a step is the machinery."""

    def __init__(self, vocab_size: int, kernel_name: str):
        self.vocab_size, self.kernel_name = vocab_size, kernel_name

    def __call__(self, ids, positions, metadata):
        return ids

    def compute_logits(self, hidden, indices):
        import torch

        return torch.zeros(len(indices), self.vocab_size)


def worker_class(model: str):
    from ray_attn.runtime import AttentionWorker

    if model != "stub":
        return AttentionWorker

    class StubModelWorker(AttentionWorker):
        def load_model(self) -> dict:
            info = super().load_model()
            self.model = StubModel(self.config.model.vocab_size, self.model.kernel_name)
            return info

    return StubModelWorker


def tiny_config(compiled: bool, device: str, model: str = "tiny") -> EngineConfig:
    if model == "8b":
        model = ModelConfig.from_name("llama-3-8b")
    else:
        model = ModelConfig.from_name("one-layer", dtype="bfloat16" if device == "cuda" else "float32")
    return EngineConfig(model=model, cache=CacheConfig(num_blocks=4096),
                        parallel=ParallelConfig(device=device, use_compiled_graph=compiled),
                        max_num_seqs=512, max_num_batched_tokens=16384)


def start_decode(engine: LLMEngine, batch: int, max_tokens: int) -> None:
    rng = np.random.default_rng(0)
    bl.start_decoding(engine, [rng.integers(0, 256, 64).tolist() for _ in range(batch)],
                      [SamplingParams(max_tokens=max_tokens)] * batch)
    engine.flush()


def decode_step_times(engine: LLMEngine, steps: int) -> dict:
    """Medians over ``steps`` decode steps: the whole step, the planner, the executor call and
    the worker's own time inside it (the call minus the worker is the transport)."""
    plan_t, step_t, call_t, worker_t = [], [], [], []
    plan, call = engine.planner.plan, engine.executor.step

    def timed_plan(s):
        t0 = time.perf_counter()
        p = plan(s)
        plan_t.append(time.perf_counter() - t0)
        return p

    def timed_call(s):
        t0 = time.perf_counter()
        out = call(s)
        call_t.append(time.perf_counter() - t0)
        worker_t.append(out.timings.get("worker_s", 0.0) if out is not None else 0.0)
        return out

    engine.planner.plan, engine.executor.step = timed_plan, timed_call
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            step_t.append(time.perf_counter() - t0)
    finally:
        engine.planner.plan, engine.executor.step = plan, call
    med = lambda xs: statistics.median(xs) * 1e6
    return {"step_us": med(step_t), "step_p90_us": float(np.percentile(step_t, 90) * 1e6),
            "plan_us": med(plan_t), "call_us": med(call_t), "worker_us": med(worker_t)}


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
    from ray_attn.runtime import AttentionCluster, InProcessExecutor

    a = argparse.ArgumentParser()
    a.add_argument("--batch", type=int, default=64)
    a.add_argument("--steps", type=int, default=100, help="per path and round")
    a.add_argument("--rounds", type=int, default=3)
    a.add_argument("--model", choices=["stub", "tiny", "8b"], default=None,
                   help="default: stub on CPU, tiny (1 layer) on GPU; 8b: the Llama-3-8B shape")
    a.add_argument("--async-scheduling", default="both", choices=["off", "on", "both"])
    args = a.parse_args(argv)
    dev = bl.device()
    device = dev.type
    model = args.model or ("tiny" if device == "cuda" else "stub")
    wcls = worker_class(model)
    compiled = lambda name: name == "compiled graph"
    paths = {"in-process (no Ray)": type("Executor", (InProcessExecutor,), {"worker_cls": wcls}),
             "classic actor call": type("Cluster", (AttentionCluster,), {"worker_cls": wcls}),
             "compiled graph": type("Cluster", (AttentionCluster,), {"worker_cls": wcls})}
    # Rounds alternate the paths, and each keeps its best round: a shared machine's background
    # load then inflates no path more than the others.  The graph is compiled only for its own
    # turn, because its actor busy-polls the channel while idle, taking a core from the others.
    # On one GPU a cluster's actor holds the device, so there the paths run one after another.
    groups = [[name] for name in paths] if device == "cuda" else [list(paths)]
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.async_scheduling]
    best, copy_us = {}, None
    for group in groups:
        engines = {}
        for name in group:
            cfg = tiny_config(compiled(name), device, model)
            engines[name] = LLMEngine(cfg, paths[name](cfg))
            start_decode(engines[name], args.batch, args.rounds * args.steps * len(modes) + 10)
            if compiled(name):
                engines[name].executor.uncompile()
        if "in-process (no Ray)" in engines:
            copy_us = plan_copy_us(engines["in-process (no Ray)"], args.batch, dev)
        for _ in range(args.rounds):
            for name, eng in engines.items():
                if compiled(name):
                    eng.executor.compile()
                for mode in modes:
                    eng.set_async_scheduling(mode)
                    r = decode_step_times(eng, args.steps)
                    best[name, mode] = min(best.get((name, mode), r), r, key=lambda x: x["step_us"])
                eng.set_async_scheduling(False)
                if compiled(name):
                    eng.executor.uncompile()
        for eng in engines.values():
            eng.executor.shutdown()
    rows = [dict(path=name, async_scheduling=mode, **r,
                 added_us=r["step_us"] - best["in-process (no Ray)", mode]["step_us"])
            for (name, mode), r in best.items()]
    name = "bench_step_overhead" + ("_8b" if model == "8b" else "")
    path = bl.save(name, rows, batch=args.batch, steps=args.steps, rounds=args.rounds,
                   model=model, plan_device_copy_us=copy_us)
    bl.print_table(rows, ["path", "async_scheduling", "step_us", "step_p90_us", "plan_us", "call_us",
                          "worker_us", "added_us"],
                   f"decode step, batch {args.batch}, {model} model, TP=1, {device}")
    print(f"plan -> device copy: {copy_us:.1f} us;  wrote {path}")
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.barh([f'{r["path"]}{" (async)" if r["async_scheduling"] else ""}' for r in rows],
            [r["step_us"] / 1e3 for r in rows])
    ax.set_xlabel("median step time (ms)")
    ax.set_title(f"Step overhead, batch {args.batch}, TP=1 ({bl.machine().get('gpu') or 'CPU'})")
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
