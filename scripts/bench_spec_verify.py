"""What verifying k draft tokens costs: a speculative step against a plain decode step, on one engine.

Issue 40's goal, on an H200 with the Llama-3-8B shape (random bf16 weights) at batch 1: a step
that verifies k=4 drafts costs <= 1.15x a plain decode step.  For each k an engine speculates
with ``num_speculative_tokens = k`` and no batch limit (so its verifying steps replay the CUDA
graphs of 1 + k-token queries); its proposer is replaced by one that proposes exactly k random
tokens for every decoding row -- or none, for the same engine's plain decode steps, the
reference -- so every step verifies k drafts whatever the weights accept.  Each point steps the
engine over ``--steps`` decode steps at a context of ``--ctx`` tokens, ``--rounds`` times each
side taken in turn, and takes the median step time (device synchronised); ``graphed`` says whether the verifying steps replayed a graph.

The weights are random, so they accept nothing; what real text accepts comes from
``bench_spec_decode.py``'s measured acceptance lengths (SmolLM2 on CPU, its JSON): the ITL that
speculation gives is verify cost / acceptance length, reported for each k that file measured.

    python scripts/bench_spec_verify.py                          # H200: llama-3-8b, k = 0..8, batch 1
    python scripts/bench_spec_verify.py --batch 1 8 32 64 --k 0 4  # where speculation stops paying
    python scripts/bench_spec_verify.py --checkpoint smollm2 --device cpu --k 0 1 2 4 --ctx 256 --steps 10
    python scripts/bench_spec_verify.py --preset tiny --device cpu --k 0 2 --steps 4 --ctx 32   # its test
    python scripts/bench_spec_verify.py --draft-preset llama-3.2-1b --k 0 2 4   # a draft model's step

``--draft-preset``: the drafts come from a draft model of that shape (random weights too) on the
same ranks -- what a step costs with its catch-up and k - 1 passes before the verification.  The
reference steps are the same engine's with speculation turned off (``disable_by_batch_size``
0).  Random weights reject the drafts, which changes nothing of what a step costs.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import benchlib as bl  # noqa: E402
from ray_attn.config import MODEL_PRESETS, CacheConfig, EngineConfig, ModelConfig, ParallelConfig  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


class DraftModelSwitch:
    """For a draft model (``--draft-preset``): ``k`` 0 turns speculation off, else on (the draft
    proposes every row's k drafts itself)."""

    def __init__(self, spec):
        self.spec = spec

    @property
    def k(self) -> int:
        return 0 if self.spec.disable_by_batch_size == 0 else self.spec.k

    @k.setter
    def k(self, value: int) -> None:
        self.spec.disable_by_batch_size = None if value else 0


class ForcedDrafts:
    """A proposer that proposes ``k`` random tokens (within what the row has room for)."""

    def __init__(self, vocab: int, seed: int = 0):
        self.k, self.vocab, self.rng = 0, vocab, np.random.default_rng(seed)

    def propose(self, tokens: np.ndarray, k: int | None = None) -> np.ndarray:
        n = self.k if k is None else min(k, self.k)
        return self.rng.integers(0, self.vocab, n).astype(tokens.dtype)


def step_times(engine, sync, batch: int, ctx: int, steps: int, vocab: int, rng) -> list[float]:
    from ray_attn.engine import SamplingParams

    prompts = [rng.integers(0, vocab, ctx).tolist() for _ in range(batch)]
    ids = bl.start_decoding(engine, prompts, [SamplingParams(max_tokens=steps * 12 + 16, ignore_eos=True)] * batch)
    for _ in range(3):  # warm-up: the first steps of a new shape compile or capture
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        sync()
        times.append(time.perf_counter() - t0)
    bl.end_requests(engine, ids)
    return times


def kernel_profile(engine, sync, ctx: int, steps: int, vocab: int, rng) -> dict:
    """One row's decode steps under torch's profiler: GPU microseconds a step by kernel kind
    (profile_decode's kinds), to say where a verifying step's extra time goes: kernels or host."""
    from torch.profiler import ProfilerActivity, profile

    from profile_decode import kernel_kinds

    from ray_attn.engine import SamplingParams

    ids = bl.start_decoding(engine, [rng.integers(0, vocab, ctx).tolist()],
                            [SamplingParams(max_tokens=steps * 12 + 16, ignore_eos=True)])
    for _ in range(3):
        engine.step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        sync()
    bl.end_requests(engine, ids)
    kinds = kernel_kinds(prof.key_averages())
    for r in kinds:
        r["us"] /= steps
        r["kernels"] /= steps
    return dict(gpu_us=sum(r["us"] for r in kinds), kinds=kinds)


def host_profile(engine, sync, ctx: int, steps: int, vocab: int, rng) -> dict[str, float]:
    """One row's decode steps under cProfile: host microseconds a step spent in each function's
    own code (``tottime``), by ``file:line(function)``."""
    import cProfile
    import pstats

    from ray_attn.engine import SamplingParams

    ids = bl.start_decoding(engine, [rng.integers(0, vocab, ctx).tolist()],
                            [SamplingParams(max_tokens=steps * 12 + 16, ignore_eos=True)])
    for _ in range(3):
        engine.step()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        engine.step()
        sync()
    pr.disable()
    bl.end_requests(engine, ids)
    return {f"{Path(f).name}:{line}({fn})": v[2] / steps * 1e6 for (f, line, fn), v in pstats.Stats(pr).stats.items()}


# (class path, method) whose wall time ``--phases`` reads, inclusive of what they call
PHASES = [("ray_attn.engine.LLMEngine", m) for m in ("flush", "_plan", "_submit", "_apply")] + [
    ("ray_attn.spec.decoder.SpecDecoder", m) for m in ("propose", "step_inputs", "accept")] + [
    ("ray_attn.planner.builder.Planner", "plan"), ("ray_attn.runtime.cluster.InProcessExecutor", "step")] + [
    ("ray_attn.runtime.worker.AttentionWorker", m) for m in (
        "_check", "_stage_sampling_inputs", "_forward", "_finish", "_sample", "_answer", "_collect_deferred")]


def phase_times(engine, sync, ctx: int, steps: int, vocab: int, rng) -> dict[str, float]:
    """One row's decode steps with the wall time of each of ``PHASES`` (microseconds a step,
    inclusive) and of the device wait after the step: where a verifying step's extra time goes on
    the host's critical path, which cProfile's self times scatter over many small functions."""
    import importlib

    from ray_attn.engine import SamplingParams

    acc: dict[str, float] = {}
    patched = []

    def timed(name, f):
        def g(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                acc[name] = acc.get(name, 0.0) + time.perf_counter() - t
        return g

    ids = bl.start_decoding(engine, [rng.integers(0, vocab, ctx).tolist()],
                            [SamplingParams(max_tokens=steps * 12 + 16, ignore_eos=True)])
    for _ in range(3):
        engine.step()
    try:
        for path, meth in PHASES:
            mod, cls = path.rsplit(".", 1)
            c = getattr(importlib.import_module(mod), cls)
            patched.append((c, meth, c.__dict__[meth]))
            setattr(c, meth, timed(f"{cls}.{meth}", c.__dict__[meth]))
        acc.clear()
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            t1 = time.perf_counter()
            sync()
            acc["step"] = acc.get("step", 0.0) + t1 - t
            acc["device_wait_after_step"] = acc.get("device_wait_after_step", 0.0) + time.perf_counter() - t1
    finally:
        for c, meth, f in patched:
            setattr(c, meth, f)
    bl.end_requests(engine, ids)
    return {k: v / steps * 1e6 for k, v in acc.items()}


def real_text_itl(points: list[dict]) -> list[dict]:
    """For each (workload, k) bench_spec_decode.json measured: the ITL that this machine's verify
    cost at batch 1 gives with that run's steps, as a fraction of plain decode.  Its replayed steps
    (``per_request``) say how many steps verified drafts (cost ``ratio``) and how many found none
    (cost 1): ITL = (drafting steps x cost + the other steps) / tokens.  vLLM's acceptance length
    (1 + accepted / drafts) counts only the drafting steps, so cost / it is shown too."""
    path = RESULTS / "bench_spec_decode.json"
    if not path.exists():
        return []
    cost = {p["k"]: p["ratio"] for p in points if p["batch"] == 1}
    out = []
    for r in json.loads(path.read_text()).get("rows", []):
        k, L = r.get("k"), r.get("acceptance_length")
        if k not in cost or not L:
            continue
        row = dict(workload=r["workload"], k=k, acceptance_length=round(L, 2), verify_cost=round(cost[k], 3),
                   itl_vs_plain_drafting_steps=round(cost[k] / L, 3))
        reqs = r.get("per_request") or []
        if reqs:
            T, S, Dd = (sum(q[f] for q in reqs) for f in ("tokens", "steps", "drafted_steps"))
            row.update(tokens_per_step=round(T / S, 2), itl_vs_plain=round((Dd * cost[k] + S - Dd) / T, 3))
        out.append(row)
    return out


def spec_config(args, k: int, model: ModelConfig) -> dict:
    if args.draft_preset is None:
        return dict(method="ngram", num_speculative_tokens=k, disable_by_batch_size=None)
    draft = MODEL_PRESETS[args.draft_preset] | {"dtype": model.dtype}
    return dict(method="draft_model", num_speculative_tokens=k, draft_model_config=draft, disable_by_batch_size=None)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-3-8b", choices=sorted(MODEL_PRESETS))
    ap.add_argument("--checkpoint", default=None, help='a checkpoint to serve instead of --preset ("smollm2": the '
                    "embedded SmolLM2-135M GGUF, the model bench_spec_decode.py's acceptance lengths come from)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--k", type=int, nargs="+", default=list(range(9)), help="draft tokens per step (0: plain)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--ctx", type=int, default=1024, help="context tokens of each row")
    ap.add_argument("--steps", type=int, default=30, help="timed steps a run")
    ap.add_argument("--rounds", type=int, default=3, help="plain/verifying run pairs a point, taken in turn")
    ap.add_argument("--profile", action="store_true", help="at batch 1: where a verifying step's extra host time "
                    "goes (cProfile) and, on CUDA, its GPU time by kernel kind")
    ap.add_argument("--phases", action="store_true", help="at batch 1: the wall time a step of the engine's, "
                    "the planner's, the decoder's and the rank's phases (plain against verifying)")
    ap.add_argument("--draft-preset", default=None, choices=sorted(MODEL_PRESETS),
                    help="drafts from a draft model of this shape (random weights) instead of forced random tokens")
    ap.add_argument("--json", default=str(RESULTS / "bench_spec_verify.json"))
    ap.add_argument("--real-text-only", action="store_true", help="recompute --json's real-text ITL from its points "
                    "and today's bench_spec_decode.json, measuring nothing")
    args = ap.parse_args(argv)
    if args.real_text_only:
        out = json.loads(Path(args.json).read_text())
        out["real_text"] = real_text_itl(out["points"])
        Path(args.json).write_text(json.dumps(out, indent=1))
        return out
    from ray_attn.engine import LLMEngine
    from ray_attn.runtime import InProcessExecutor

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    model = ModelConfig(**(MODEL_PRESETS[args.preset] | {"dtype": "bfloat16" if cuda else "float32"}))
    if args.checkpoint:  # a real checkpoint instead of the preset ("smollm2": the embedded GGUF)
        from ray_attn.presets import default_gguf

        source = dict(checkpoint=str(default_gguf()) if args.checkpoint == "smollm2" else args.checkpoint)
    else:
        source = dict(model=model)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rng = np.random.default_rng(0)
    points, info = [], {}
    # A fixed cache (every row's context and its steps' tokens, twice over): sized from memory, the
    # second engine's profile would count the first one's memory not yet returned as its own.
    blocks = 2 * max(args.batch) * -(-(args.ctx + args.steps * (max(args.k) + 1) + 64) // 16) + 64
    for k in sorted({k for k in args.k if k > 0} or {1}):  # k = 0: each engine's own plain step
        cfg = EngineConfig(**source, cache=CacheConfig(num_blocks=blocks if cuda else 512),
                           parallel=ParallelConfig(device="cuda" if cuda else "cpu",
                                                   kernel="auto" if cuda else "torch"),
                           max_num_seqs=max(args.batch), max_num_batched_tokens=max(2048, max(args.batch) * (k + 1)),
                           speculative_config=spec_config(args, k, model))
        engine = LLMEngine(cfg, InProcessExecutor(cfg))
        vocab = engine.config.model.vocab_size
        if args.draft_preset:
            proposer = DraftModelSwitch(engine.spec)
        else:
            proposer = engine.spec.proposer = ForcedDrafts(vocab)
        graphs = getattr(engine.executor.worker, "spec_graphs", None)
        try:
            for batch in args.batch:
                # Plain and verifying runs taken in turn, ``--rounds`` times: the machine's drift
                # (clocks, a neighbour) then falls on both sides alike, not on whichever ran second.
                times = {0: [], k: []}
                for _ in range(args.rounds):
                    for kk in (0, k):
                        proposer.k = kk
                        drafts0 = engine.spec.stats.num_draft_tokens
                        times[kk] += step_times(engine, sync, batch, args.ctx, args.steps, vocab, rng)
                        verified = engine.spec.stats.num_draft_tokens - drafts0
                        if kk and verified < kk * batch * args.steps:
                            raise RuntimeError(f"k={kk} batch={batch}: only {verified} drafts verified; the point "
                                               "did not run")
                ms = {kk: statistics.median(t) * 1e3 for kk, t in times.items()}
                graphed = bool(graphs is not None and graphs.graphs and batch <= graphs.sizes[-1])
                prof = {}
                if args.profile and batch == 1:
                    host = {}
                    for kk in (0, k):
                        proposer.k = kk
                        host[kk] = host_profile(engine, sync, args.ctx, 10, vocab, rng)
                    grew = sorted(((host[k].get(f, 0.0) - host[0].get(f, 0.0), f) for f in set(host[0]) | set(host[k])),
                                  reverse=True)[:12]
                    prof["host_self_us_growth"] = [dict(function=f, us=round(d, 1)) for d, f in grew]
                    print(f"  k={k} batch 1 host self time a step, largest growth plain -> verifying: " + ", ".join(
                        f"{f} +{d:.0f} us" for d, f in grew), flush=True)
                if args.phases and batch == 1:
                    ph = {}
                    for kk in (0, k):
                        proposer.k = kk
                        ph[kk] = phase_times(engine, sync, args.ctx, 20, vocab, rng)
                    prof["phases_us"] = {n: [round(ph[0].get(n, 0.0), 1), round(ph[k].get(n, 0.0), 1)]
                                         for n in sorted(set(ph[0]) | set(ph[k]))}
                    print(f"  k={k} batch 1 wall time a step (us, plain -> verifying, inclusive):", flush=True)
                    for n, (a, b) in prof["phases_us"].items():
                        print(f"    {n:45s} {a:9.1f} -> {b:9.1f}  ({b - a:+.1f})", flush=True)
                if args.profile and cuda and batch == 1:
                    for kk in (0, k):
                        proposer.k = kk
                        prof[kk] = kernel_profile(engine, sync, args.ctx, 5, vocab, rng)
                    kinds = {r["kind"] for kk in (0, k) for r in prof[kk]["kinds"]}
                    us = {kk: {r["kind"]: r["us"] for r in prof[kk]["kinds"]} for kk in (0, k)}
                    print(f"  k={k} batch 1 GPU time a step: plain {prof[0]['gpu_us']:.0f} us, verifying "
                          f"{prof[k]['gpu_us']:.0f} us; by kind (plain -> verifying): " + ", ".join(
                              f"{n} {us[0].get(n, 0):.0f} -> {us[k].get(n, 0):.0f}" for n in sorted(kinds)), flush=True)
                if 0 in args.k and not any(p["batch"] == batch and p["k"] == 0 for p in points):
                    points.append(dict(batch=batch, k=0, step_ms=round(ms[0], 3), ratio=1.0, graphed=None))
                p = dict(batch=batch, k=k, step_ms=round(ms[k], 3), plain_ms=round(ms[0], 3),
                         ratio=round(ms[k] / ms[0], 3), graphed=graphed)
                if prof:
                    p["profile"] = {("plain" if kk == 0 else "verify" if kk == k else kk): v for kk, v in prof.items()}
                points.append(p)
                print(f"batch {batch:3d}  k={k}  verify {ms[k]:8.3f} ms  plain {ms[0]:8.3f} ms  {p['ratio']:.3f}x"
                      f"{'  (graphs)' if graphed else ''}", flush=True)
        finally:
            info = engine.executor.infos[0]
            engine.shutdown()
            del engine, proposer, graphs
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    points.sort(key=lambda p: (p["batch"], p["k"]))
    out = dict(machine=bl.machine(), preset=args.preset, checkpoint=args.checkpoint, draft_preset=args.draft_preset,
               ctx=args.ctx, steps=args.steps, rounds=args.rounds, kernel=info.get("kernel"),
               cuda_graphs=info.get("cuda_graphs"), points=points, goal=dict(k=4, batch=1, max_ratio=1.15),
               # n-gram's acceptance lengths on real text say nothing of a draft model's
               real_text=[] if args.draft_preset else real_text_itl(points))
    for r in out["real_text"]:
        line = (f"{r['workload']:5s} k={r['k']}: acceptance length {r['acceptance_length']:.2f} (SmolLM2, CPU), verify "
                f"cost {r['verify_cost']:.3f}: ITL {r['itl_vs_plain_drafting_steps']:.2f}x plain on drafting steps")
        if "itl_vs_plain" in r:
            line += f", {r['itl_vs_plain']:.2f}x over all steps ({r['tokens_per_step']:.2f} tokens a step)"
        print(line)
    if args.json:
        bl.write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
