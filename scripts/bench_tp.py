"""Tensor-parallel runs on one host: greedy tokens equal across TP sizes (and survive a killed
rank), decode tokens/s for TP = 1, 2, 4, 8 (as many GPUs as there are), scaling efficiency, and
the share of device time in all-reduce versus attention.

    python scripts/bench_tp.py                    # GPU host: Llama-3-8B shape, TP up to #GPUs
    python scripts/bench_tp.py --max-tp 2         # CPU: tiny model, TP 1 and 2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402
from bench_e2e import ours  # noqa: E402

from ray_attn.config import MODEL_PRESETS, CacheConfig, EngineConfig, ModelConfig, ParallelConfig  # noqa: E402
from ray_attn.engine import LLMEngine, SamplingParams  # noqa: E402
from ray_attn.runtime import StepInput  # noqa: E402


def engine_for(m: dict, tp: int, gpu: bool, compiled: bool = True, num_blocks=None,
               cuda_graphs: str = "auto") -> LLMEngine:
    cfg = EngineConfig(model=ModelConfig(**m), cache=CacheConfig(num_blocks=num_blocks),
                       parallel=ParallelConfig(tensor_parallel_size=tp, device="cuda" if gpu else "cpu",
                                               use_compiled_graph=compiled, cuda_graphs=cuda_graphs),
                       max_num_seqs=256, max_num_batched_tokens=8192 if gpu else 1024)
    return LLMEngine(cfg)


def greedy(engine: LLMEngine, prompts, max_tokens: int, kill_rank_at: int | None = None):
    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens)) for p in prompts]
    step = 0
    while engine.has_unfinished_requests():
        if kill_rank_at is not None and step == kill_rank_at:
            ray.kill(engine.executor.workers[-1])
        engine.step()
        step += 1
    return [engine.output(i).output_token_ids for i in ids]


def profile_decode(engine: LLMEngine, batch: int, ctx: int, vocab: int) -> dict:
    """Device time split of one decode step on rank 0."""
    rng = np.random.default_rng(1)
    # Long enough that no request finishes before the last one is prefilled.
    ids = bl.start_decoding(engine, [rng.integers(0, vocab, ctx).tolist() for _ in range(batch)],
                            [SamplingParams(max_tokens=2048)] * batch)
    engine.flush()  # async scheduling: no step may be out while we plan one by hand
    from ray_attn.planner import ScheduledRequest

    # Only what the cache holds at once: at TP=1, 256 x 4k tokens of Llama-3-8B KV (134 GB) do
    # not fit next to the weights, and the engine then decodes fewer requests per step.
    p = engine.planner
    reqs = [r for r in engine.running
            if p.has_request(r.request_id) and p.num_computed_tokens(r.request_id) == len(r.all_token_ids) - 1]
    plan = p.plan([ScheduledRequest(r.request_id, r.all_token_ids, 1) for r in reqs])
    B = plan.num_reqs
    step = StepInput(plan, np.zeros(B, np.float32), -np.ones(B, np.int64), np.zeros(B, np.int32))
    was = engine.executor.compiled
    engine.executor.uncompile()
    split = ray.get([w.profile_step.remote(step) for w in engine.executor.workers])[0]
    if was:
        engine.executor.compile()
    bl.end_requests(engine, ids)
    return split, len(reqs)


def main(argv=None):
    a = argparse.ArgumentParser()
    a.add_argument("--max-tp", type=int, default=None)
    a.add_argument("--steps", type=int, default=16)
    a.add_argument("--cuda-graphs", default="auto", choices=["auto", "on", "off"],
                   help="'on' also captures TP>1 decode steps (NCCL all-reduce inside the graph)")
    args = a.parse_args(argv)
    gpu = torch.cuda.is_available()
    ngpu = torch.cuda.device_count() if gpu else 0
    max_tp = args.max_tp or (ngpu if gpu else 2)
    tps = [t for t in (1, 2, 4, 8) if t <= max_tp]
    m = MODEL_PRESETS["llama-3-8b" if gpu else "tiny"]
    # Correctness in float32: bf16 all-reduce order moves logits by a few bf16 steps, which can
    # flip a greedy near-tie; float32 runs the torch kernel on the GPU.
    m32 = dict(m, dtype="float32", num_hidden_layers=4 if gpu else m["num_hidden_layers"])
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, m["vocab_size"], int(n)).tolist() for n in (40, 77, 130, 200)]
    correctness = []
    ref = None
    for tp in tps:
        eng = engine_for(m32, tp, gpu, compiled=False, num_blocks=512)
        toks = greedy(eng, prompts, 12)
        ref = ref or toks
        row = dict(tp=tp, same_as_tp1=toks == ref)
        if tp > 1:
            t0 = time.perf_counter()
            faulted = greedy(eng, prompts, 12, kill_rank_at=5)
            row.update(same_after_killed_rank=faulted == ref, recovery_s=eng.stats.last_recovery_s,
                       fault_run_s=time.perf_counter() - t0)
        eng.shutdown()
        correctness.append(row)
    bl.print_table(correctness, ["tp", "same_as_tp1", "same_after_killed_rank", "recovery_s"],
                   "greedy tokens vs TP=1 (float32)")
    batches, ctx = ([64, 256], 4096) if gpu else ([4, 16], 128)
    scaling = []
    for tp in tps:
        eng = engine_for(m, tp, gpu, cuda_graphs=args.cuda_graphs)
        for b in batches:
            tps_, step_s, _ = ours(eng, b, ctx, args.steps, m["vocab_size"])
            p0 = eng.stats.preemptions
            split, resident = profile_decode(eng, b, ctx, m["vocab_size"])
            total = sum(split.values()) or 1.0
            scaling.append(dict(tp=tp, batch=b, ctx=ctx, tok_s=tps_, step_ms=step_s * 1e3,
                                resident_reqs=resident, preemptions=eng.stats.preemptions - p0,
                                allreduce_share=split["all_reduce"] / total,
                                attention_share=split["attention"] / total))
        eng.shutdown()
    base = {r["batch"]: r["tok_s"] for r in scaling if r["tp"] == 1}
    for r in scaling:
        r["speedup"] = r["tok_s"] / base[r["batch"]]
        r["efficiency"] = r["speedup"] / r["tp"]
    path = bl.save("bench_tp", scaling, correctness=correctness, cuda_graphs=args.cuda_graphs, model=m, gpus=ngpu)
    bl.print_table(scaling, ["tp", "batch", "ctx", "tok_s", "step_ms", "speedup", "efficiency",
                             "resident_reqs", "preemptions", "allreduce_share", "attention_share"],
                   "decode scaling")
    series = {f"batch {b}": ([r["tp"] for r in scaling if r["batch"] == b],
                             [r["tok_s"] for r in scaling if r["batch"] == b]) for b in batches}
    bl.plot(path.with_suffix(".png"), series, "tensor-parallel size", "decode tokens/s",
            f"TP scaling ({bl.machine().get('gpu') or 'CPU'})")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
