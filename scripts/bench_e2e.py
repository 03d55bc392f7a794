"""Decode tokens/s of the whole engine on a Llama-3-8B-shaped model with random weights, against
HF transformers ``generate`` (sdpa) on the same model shape and the memory roofline -- all in one run.

Roofline per decode step = (weight bytes + KV bytes read) / device-copy bandwidth measured here.
Also a shared-prompt workload (prompts x samples) with cascade on and off.

    python scripts/bench_e2e.py              # GPU: Llama-3-8B shape; CPU: a tiny shape
    python scripts/bench_e2e.py --skip-hf    # without the transformers baseline
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

from ray_attn.config import MODEL_PRESETS, CacheConfig, EngineConfig, ModelConfig, ParallelConfig  # noqa: E402
from ray_attn.engine import LLMEngine, SamplingParams  # noqa: E402



def weight_bytes(m: dict) -> int:
    h, i, L, V = m["hidden_size"], m["intermediate_size"], m["num_hidden_layers"], m["vocab_size"]
    hd = h // m["num_attention_heads"]
    attn = h * hd * (m["num_attention_heads"] * 2 + m["num_key_value_heads"] * 2)
    per_layer = attn + 3 * h * i + 2 * h
    el = 2 if m["dtype"] != "float32" else 4
    return (L * per_layer + 2 * V * h + h) * el


def gemm_flops_per_token(m: dict) -> float:
    """The weight GEMMs' FLOPs for one decode token: 2 per weight, the embedding excluded."""
    params = (weight_bytes(m) // (2 if m["dtype"] != "float32" else 4)) - m["vocab_size"] * m["hidden_size"]
    return 2 * params


def kv_bytes_per_token(m: dict) -> int:
    hd = m["hidden_size"] // m["num_attention_heads"]
    el = 2 if m["dtype"] != "float32" else 4
    return 2 * m["num_hidden_layers"] * m["num_key_value_heads"] * hd * el


def ours(engine: LLMEngine, batch: int, ctx: int, steps: int, vocab: int, prompts=None, params=None):
    """Median-free simple rate: prefill everything, then time ``steps`` pure decode steps."""
    rng = np.random.default_rng(batch * 7919 + ctx)
    if prompts is None:
        prompts = [rng.integers(0, vocab, ctx).tolist() for _ in range(batch)]
        # Long enough that the first requests are still decoding when the last finish prefill.
        params = [SamplingParams(max_tokens=min(2048, engine.config.model.max_position_embeddings - ctx - 1))] * batch
    ids = bl.start_decoding(engine, prompts, params)
    c0 = engine.stats.cascade_steps
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    t0 = time.perf_counter()
    n = 0
    for _ in range(steps):
        n += len(engine.step())
    dt = time.perf_counter() - t0
    cascade = engine.stats.cascade_steps - c0
    bl.end_requests(engine, ids)
    return n / dt, dt / steps, cascade


def hf_step_time(model, batch: int, ctx: int, vocab: int, steps: int = 24, repeats: int = 2) -> float:
    """Seconds per decode step of HF generate, timed step by step: a logits processor stamps the
    clock as each step's logits arrive (after a device sync, which generate does every step anyway
    to check its stopping criteria), and the step time is the median gap, the best of ``repeats``
    runs.  Timing two generate lengths and dividing their difference -- what we did before -- put
    the prefill's jitter into the step: the same point measured 20 and 41 ms on one day."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Stamp(LogitsProcessor):
        def __init__(self):
            self.t = []

        def __call__(self, input_ids, scores):
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            self.t.append(time.perf_counter())
            return scores

    ids = torch.randint(0, vocab, (batch, ctx), device=model.device)
    best = float("inf")
    for _ in range(repeats):
        stamp = Stamp()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps,
                       min_new_tokens=steps, do_sample=False, pad_token_id=0,
                       logits_processor=LogitsProcessorList([stamp]))
        best = min(best, float(np.median(np.diff(stamp.t))))
    return best


def hf_model(m: dict, dev):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{k: v for k, v in m.items() if k != "dtype"}, attn_implementation="sdpa")
    dtype = getattr(torch, m["dtype"])
    with torch.device(dev):
        model = LlamaForCausalLM._from_config(cfg, dtype=dtype)
    return model.eval()


def plot(rows: list[dict], png) -> None:
    series = {}
    for c in sorted({r["ctx"] for r in rows}):
        pts = [r for r in rows if r["ctx"] == c]
        series[f"ray_attn ctx {c}"] = ([r["batch"] for r in pts], [r["ours_tok_s"] for r in pts])
        series[f"roofline ctx {c}"] = ([r["batch"] for r in pts],
                                       [r["batch"] / r["roofline_step_ms"] * 1e3 for r in pts])
        # A non-positive HF step time is a failed measurement (see hf_step_time), not a point.
        hf = [r for r in pts if r.get("hf_tok_s", 0) > 0]
        if hf:
            series[f"HF transformers ctx {c}"] = ([r["batch"] for r in hf], [r["hf_tok_s"] for r in hf])
    bl.plot(png, series, "batch", "decode tokens/s", "End-to-end decode, Llama-3-8B shape")


def main(argv=None):
    a = argparse.ArgumentParser()
    a.add_argument("--replot", metavar="JSON", help="redraw the PNG of a saved run (no timing)")
    a.add_argument("--skip-hf", action="store_true")
    a.add_argument("--steps", type=int, default=16)
    a.add_argument("--compiled", action="store_true", default=True)
    a.add_argument("--points", help="only these decode points, e.g. 64x1024,32x4096 (HF where its grid overlaps)")
    a.add_argument("--no-shared", action="store_true", help="skip the shared-prompt workload")
    a.add_argument("--cuda-graphs", default="auto", choices=["auto", "on", "off"])
    a.add_argument("--async-scheduling", default="both", choices=["on", "off", "both"],
                   help="the headline runs async when on/both; 'both' also times each point synchronously")
    args = a.parse_args(argv)
    if args.replot:
        import json

        plot(json.loads(Path(args.replot).read_text())["rows"], Path(args.replot).with_suffix(".png"))
        return
    dev = bl.device()
    gpu = dev.type == "cuda"
    m = MODEL_PRESETS["llama-3-8b" if gpu else "tiny"]
    grid = ([(1, 1024), (1, 8192), (32, 1024), (32, 4096), (64, 1024), (64, 4096), (128, 1024),
             (256, 1024)] if gpu else [(1, 128), (8, 128), (8, 512)])
    hf_grid = [(1, 1024), (32, 1024), (64, 1024), (32, 4096)] if gpu else [(1, 128), (8, 128)]
    if args.points:
        grid = [tuple(int(x) for x in p.split("x")) for p in args.points.split(",")]
        hf_grid = [p for p in hf_grid if p in grid]
    copy_bw = bl.copy_bandwidth(1 << 30 if gpu else 1 << 24, dev)
    peak_flops = bl.matmul_flops(dev)
    rows = []
    hf = {}
    if not args.skip_hf:
        model = hf_model(m, dev)
        with torch.inference_mode():
            for b, c in tqdm(hf_grid, desc="HF generate"):
                hf[(b, c)] = hf_step_time(model, b, c, m["vocab_size"])
        del model
        gc.collect()
        torch.cuda.empty_cache() if gpu else None
    cfg = EngineConfig(model=ModelConfig(**m), cache=CacheConfig(block_size=16, num_blocks=None if gpu else 2048),
                       parallel=ParallelConfig(device="cuda" if gpu else "cpu",
                                               use_compiled_graph=args.compiled,
                                               cuda_graphs=args.cuda_graphs),
                       max_num_seqs=256, max_num_batched_tokens=8192 if gpu else 1024)
    engine = LLMEngine(cfg)
    info = engine.executor.infos[0]
    headline_async = args.async_scheduling != "off"
    for b, c in tqdm(grid, desc="ray_attn engine"):
        row = dict(batch=b, ctx=c, async_scheduling=headline_async)
        if args.async_scheduling == "both":  # the same engine, synchronously, for comparison
            engine.set_async_scheduling(False)
            _, sync_s, _ = ours(engine, b, c, args.steps, m["vocab_size"])
            row["sync_step_ms"] = sync_s * 1e3
        engine.set_async_scheduling(headline_async)
        tps, step_s, _ = ours(engine, b, c, args.steps, m["vocab_size"])
        roof_s = (weight_bytes(m) + b * c * kv_bytes_per_token(m)) / copy_bw
        # The memory roofline is the goal's yardstick.  But a layer runs its GEMMs and its
        # attention one after the other, and at large batch the GEMMs are compute-bound: so also
        # max(weights / bandwidth, GEMM FLOPs / the GEMM rate above) + KV / bandwidth.
        both_s = (max(weight_bytes(m) / copy_bw, b * gemm_flops_per_token(m) / peak_flops)
                  + b * c * kv_bytes_per_token(m) / copy_bw)
        row.update(ours_tok_s=tps, ours_step_ms=step_s * 1e3, roofline_step_ms=roof_s * 1e3,
                   frac_of_roofline=roof_s / step_s, compute_roofline_step_ms=both_s * 1e3,
                   frac_of_mem_compute_roofline=both_s / step_s)
        if (b, c) in hf:
            row.update(hf_step_ms=hf[(b, c)] * 1e3, hf_tok_s=b / hf[(b, c)], speedup_vs_hf=hf[(b, c)] / step_s)
        rows.append(row)
    shared = []
    groups, samples, plen = (16, 8, 4096) if gpu else (4, 4, 256)
    rng = np.random.default_rng(5)
    prompts, params = [], []
    for g in range(groups):
        base = rng.integers(0, m["vocab_size"], plen).tolist()
        for s in range(samples):
            prompts.append(base + [int(rng.integers(0, m["vocab_size"]))])
            params.append(SamplingParams(max_tokens=2048, temperature=0.8, seed=g * 100 + s))
    for cascade in () if args.no_shared else (True, False):
        engine.planner.enable_cascade = cascade
        tps, step_s, nc = ours(engine, len(prompts), plen, args.steps, m["vocab_size"], prompts, params)
        shared.append(dict(workload=f"{groups} prompts x {samples} samples, {plen}-token prompt",
                           cascade_enabled=cascade, tok_s=tps, step_ms=step_s * 1e3, cascade_steps=nc))
    engine.planner.enable_cascade = True
    engine.shutdown()
    path = bl.save("bench_e2e", rows, shared_prompt=shared, copy_GBps=copy_bw / 1e9,
                   matmul_TFLOPs=peak_flops / 1e12,
                   model=m, weight_GB=weight_bytes(m) / 1e9, kernel=info["kernel"])
    bl.print_table(rows, ["batch", "ctx", "ours_tok_s", "ours_step_ms", "sync_step_ms", "roofline_step_ms",
                          "frac_of_roofline", "frac_of_mem_compute_roofline", "hf_tok_s", "hf_step_ms", "speedup_vs_hf"],
                   f"decode, {'Llama-3-8B shape' if gpu else 'tiny model'}, kernel {info['kernel']}")
    bl.print_table(shared, ["workload", "cascade_enabled", "tok_s", "step_ms", "cascade_steps"],
                   "shared-prompt workload")
    plot(rows, path.with_suffix(".png"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
