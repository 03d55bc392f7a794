"""Time ``Planner.plan`` for one step on the CPU (numpy only, no GPU).

Scenarios: 8 / 64 / 256 / 1024 running requests; decode-only (one token each) or mixed (a quarter
of the requests prefill a 64-token chunk); with or without cascade groups (groups of 8 requests
share a prompt, as in RL rollouts with 8 samples per prompt); with or without chunked local
attention.  Prompt lengths are staggered so that blocks fill on different steps, as in serving.

Each case runs ``--rounds`` times from a fresh planner; the round with the lowest median is
reported (median and p90 of its steps), which filters out other processes sharing the machine.
Prints a table and writes benchmarks/results/bench_planner.json.

    python scripts/bench_planner.py [--steps 200] [--rounds 3] [--sizes 8 64 256 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ray_attn.planner import Planner, ScheduledRequest  # noqa: E402

BLOCK = 16
CHUNK = 256  # local attention chunk (small, so that the virtual batches are non-trivial)


class Req:
    """What an engine keeps per request: the planner reads these three attributes."""

    __slots__ = ("req_id", "token_ids", "num_new_tokens")

    def __init__(self, req_id, token_ids):
        self.req_id, self.token_ids, self.num_new_tokens = req_id, token_ids, 1


def make_state(B: int, groups: bool, local: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    planner = Planner(
        num_blocks=B * 200 + 64, block_size=BLOCK, num_query_heads=32, num_kv_heads=8,
        attention_chunk_size=CHUNK if local else None, max_num_reqs_hint=B,
    )
    if groups:  # B/8 prompts x 8 samples: samples share the prompt's full blocks
        n_prompts = max(B // 8, 1)
        prompts = [rng.integers(0, 32000, int(rng.integers(300, 1500))).tolist() for _ in range(n_prompts)]
        reqs = [Req(i, list(prompts[i % n_prompts])) for i in range(B)]
        planner.plan([ScheduledRequest(r.req_id, r.token_ids) for r in reqs[:n_prompts]])
        planner.plan([ScheduledRequest(r.req_id, r.token_ids) for r in reqs[n_prompts:]])
    else:
        reqs = [Req(i, rng.integers(0, 32000, int(rng.integers(300, 1500))).tolist()) for i in range(B)]
        planner.plan([ScheduledRequest(r.req_id, r.token_ids) for r in reqs])
    for r in reqs:
        r.token_ids.append(int(rng.integers(0, 32000)))
        if groups:
            r.token_ids.append(int(rng.integers(0, 32000)))  # let samples diverge at once
    planner.plan(reqs)  # settle: every request now decodes one token per step
    for r in reqs:
        r.token_ids.append(int(rng.integers(0, 32000)))
    return planner, reqs, rng


def bench(B: int, mixed: bool, groups: bool, local: bool, steps: int, seed: int = 0) -> dict:
    planner, reqs, rng = make_state(B, groups, local, seed)
    times = []
    extra = 0
    reasons = set()
    next_id = B
    for _ in range(steps):
        sched = reqs
        if mixed:  # a quarter of the batch is fresh requests prefilling a 64-token chunk
            k = max(B // 4, 1)
            for r in reqs[:k]:
                planner.free(r.req_id)
            fresh = [Req(next_id + j, rng.integers(0, 32000, 64).tolist()) for j in range(k)]
            for r in fresh:
                r.num_new_tokens = 64
            next_id += k
            reqs = fresh + reqs[k:]
            sched = reqs
        t0 = time.perf_counter()
        plan = planner.plan(sched)
        times.append(time.perf_counter() - t0)
        reasons.add(plan.cascade_reason.split(":")[0])
        extra += plan.num_cascade_groups
        toks = rng.integers(0, 32000, len(reqs)).tolist()
        for r, t in zip(reqs, toks, strict=True):  # the engine appends each sampled token
            r.token_ids.append(t)
            r.num_new_tokens = 1
    us = np.asarray(times[steps // 10 :]) * 1e6  # drop warm-up
    return {
        "num_reqs": B, "mixed": mixed, "cascade_groups": groups, "local_attention": local,
        "median_us": float(np.median(us)), "p90_us": float(np.percentile(us, 90)),
        "mean_groups": extra / steps, "cascade_reasons": sorted(reasons),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 256, 1024])
    default_out = Path(__file__).resolve().parents[1] / "benchmarks/results/bench_planner.json"
    ap.add_argument("--out", default=str(default_out))
    args = ap.parse_args()
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = lambda x, **_: x  # noqa: E731
    flags = (False, True)
    cases = [(B, m, g, loc) for B in args.sizes for m in flags for g in flags for loc in flags]
    rows = []
    for B, m, g, loc in tqdm(cases, desc="planner", file=sys.stderr):
        steps = args.steps if B < 1024 else max(args.steps // 2, 20)
        runs = [bench(B, m, g, loc, steps, seed) for seed in range(args.rounds)]
        rows.append(min(runs, key=lambda r: r["median_us"]))
    head = f"{'reqs':>5} {'batch':>7} {'groups':>6} {'local':>5} {'median us':>10} {'p90 us':>9}  cascade"
    print(head)
    print("-" * len(head))
    yes = lambda x: "yes" if x else "no"  # noqa: E731
    for r in rows:
        print(f"{r['num_reqs']:>5} {'mixed' if r['mixed'] else 'decode':>7} {yes(r['cascade_groups']):>6} "
              f"{yes(r['local_attention']):>5} {r['median_us']:>10.1f} {r['p90_us']:>9.1f}  "
              f"{'/'.join(r['cascade_reasons'])[:48]}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"python": platform.python_version(), "numpy": np.__version__, "machine": platform.machine(),
            "cpus": os.cpu_count(), "steps": args.steps, "rounds": args.rounds, "block_size": BLOCK,
            "local_chunk": CHUNK, "load_average": os.getloadavg()}
    out.write_text(json.dumps({"meta": meta, "results": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
