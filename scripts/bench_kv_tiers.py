#!/usr/bin/env python
"""KV tiers below the device cache (issue 26): the host tier, the shared store, their copies and
when a shared fetch pays.

- ``--part host``: ``--users`` conversations of ``--turns`` turns over long documents (turn t's
  prompt: the user's document, every earlier question and answer, a new question; greedy answers,
  ignore_eos), closed loop with ``--concurrency`` requests in flight: a user's next turn joins the
  back of the queue when its answer ends.  The device KV cache is capped below the working set
  (``--num-blocks``; the ratio is printed) and the same workload runs with the host tier off
  (recompute) and on; the greedy tokens must be identical.  Then the working set fits the
  device cache and the tier on vs off shows what it costs when it has nothing to do.
- ``--part share``: two replicas of one config, turn t of user u sent to replica (u + t) % 2 (a
  router without affinity), the shared store off vs on.  Each replica is driven by its own thread.
- ``--part copy``: ``RankKVTiers.gather``/``scatter`` (and the host tier's offload/onload) of n
  blocks against a bare copy of the same bytes (pinned host <-> device on CUDA; a tensor copy on
  CPU).
- ``--part breakeven``: fetching n blocks from the store (``SharedKVClient.lookup`` + the store's
  get + scatter) against prefilling them (the TTFT of n blocks + 1 token with nothing cached, less
  a 1-token prompt's: a request that fetches still computes its last token in a step); the
  smallest prefix from which the fetch wins is the machine's ``CacheConfig.kv_share_min_tokens``;
  where it wins only up to some length (a GPU: prefill costs nearly the same from 16 tokens to
  1,000), the largest such length is its ``kv_share_max_tokens``.
  Also end to end: a replica's TTFT on a prompt the store holds against computing it.

    python scripts/bench_kv_tiers.py                        # CPU: a small random model, every part
    python scripts/bench_kv_tiers.py --part host --users 24 --concurrency 4
    python scripts/bench_kv_tiers.py --device cuda --model llama-3-8b --part host,share
        # GPU defaults: 200 users x 8 turns over 8k-token documents, KV capped 3x below them

Writes benchmarks/results/bench_kv_tiers.json (a part run alone replaces only its own results)
and bench_kv_tiers.png.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402
from kv_tiers_micro import measured_window, part_breakeven, part_copy  # noqa: E402
from kv_tiers_setup import (  # noqa: E402
    DEFAULTS, PARTS, block_bytes, capped_gib, clear_store, describe, engine_config, free, make_engine,
    model_config, start_ray)
from multiturn import Workload, run_loop, same_tokens  # noqa: E402

from ray_attn.config import CacheConfig  # noqa: E402


# ---------------------------------------------------------------------------- parts
def part_host(a):
    wl = Workload(a, model_config(a).vocab_size)
    nb = a.num_blocks or max(wl.working_blocks // 3, a.concurrency * (wl.request_blocks + 1))
    # where the working set fits: all of it on CPU; on a GPU the users that a cache like the capped
    # one holds (the whole working set is meant not to fit there)
    fit_users = a.fit_users or (a.users if a.device == "cpu" else
                                max(1, min(a.users, nb // wl.request_blocks - a.concurrency)))
    fwl = wl.subset(fit_users)
    fit = a.fit_num_blocks or fwl.working_blocks + a.concurrency * (wl.request_blocks + 1)
    host_gib = a.host_gib or capped_gib(1.25 * wl.working_blocks * block_bytes(a), "host tier")
    ratio = wl.working_blocks / nb
    print(f"[host] working set {wl.working_blocks} blocks ({a.users} users x {wl.request_blocks}); device cache "
          f"{nb} blocks: the working set is {ratio:.1f}x what it holds; host tier {host_gib:.3g} GiB")
    if not 2 <= ratio <= 4:
        print("[host] note: the ratio is outside 2-4 (raise --users or set --num-blocks)")
    if a.executor == "cluster":
        start_ray(a)
    rows, answers, ttfts, gaps = [], {}, {}, {}
    for run, blocks, gib in (("capped, tier off", nb, 0.0), ("capped, tier on", nb, host_gib)):
        eng = make_engine(a, engine_config(a, blocks, host_gib=gib), a.executor == "cluster")
        row, answers[run], ttfts[run], gaps[run] = run_loop(a, run, [eng], wl, lambda u, t: 0)
        rows.append(row | dict(tier="on" if gib else "off", fits=False))
        free(eng)
    base = "capped, tier off"
    check = same_tokens(answers[base], answers["capped, tier on"], "[host] capped, tier off vs on",
                        *tie_args(a, gaps[base], gaps["capped, tier on"]))
    fit_rows = {"off": [], "on": []}
    order = ["off", "on", "on", "off"] * a.fit_repeats
    for i, tier in enumerate(order[: 2 * a.fit_repeats]):
        run = f"fits, tier {tier}"
        eng = make_engine(a, engine_config(a, fit, host_gib=host_gib if tier == "on" else 0.0), a.executor == "cluster")
        row, ans, _, g = run_loop(a, run, [eng], fwl, lambda u, t: 0)
        free(eng)
        c = same_tokens(answers[base], ans, f"[host] capped, tier off vs {run}", *tie_args(a, gaps[base], g))
        for k in ("tokens_identical", "forks_at_near_ties"):
            check[k] &= c[k]
        for k in ("differing_requests", "forks", "fork_gaps"):
            check[k] += c[k]
        fit_rows[tier].append(row | dict(tier=tier, fits=True, repeat=i // 2))
    best = {t: max(rs, key=lambda r: r["out_tok_s"]) for t, rs in fit_rows.items()}
    fit_ratio = best["on"]["out_tok_s"] / best["off"]["out_tok_s"]
    # On a shared CPU the wall clock swings by several % between identical runs; the CPU time
    # the run took (ranks in this process) barely does.
    cpu_ratio = min(r["cpu_s"] for r in fit_rows["off"]) / min(r["cpu_s"] for r in fit_rows["on"])
    rows += fit_rows["off"] + fit_rows["on"]
    print(f"[host] working set fits ({fit_users} users, {fit} blocks): throughput tier on / off = {fit_ratio:.3f} "
          f"(best of {a.fit_repeats} each; goal >= 0.98); CPU time off / on = {cpu_ratio:.3f}")
    meta = dict(users=a.users, turns=a.turns, doc_tokens=a.doc_tokens, question_tokens=a.question_tokens,
                answer_tokens=a.answer_tokens, concurrency=a.concurrency, working_set_blocks=wl.working_blocks,
                num_blocks=nb, working_set_over_cache=ratio, fit_users=fit_users, fit_num_blocks=fit,
                host_cache_gib=host_gib,
                fit_throughput_ratio=fit_ratio, fit_repeats=a.fit_repeats,
                fit_cpu_time_ratio=cpu_ratio if a.executor != "cluster" else None, **check,
                ttft_s={k: [round(x, 5) for x in ttfts[k]] for k in ("capped, tier off", "capped, tier on")})
    return [r | {"part": "host"} for r in rows], meta


def tie_args(a, *gaps) -> tuple:
    """``same_tokens``'s near-tie arguments: both runs' gaps and the margin, or none (exact)."""
    return (gaps, a.tie_margin) if a.tie_margin else ()


def part_share(a):
    start_ray(a)
    wl = Workload(a, model_config(a).vocab_size)
    nb = a.num_blocks or max(wl.working_blocks // 3, a.concurrency * (wl.request_blocks + 1))
    print(f"[share] 2 replicas of {nb} blocks each, working set {wl.working_blocks} blocks; turn t of user u "
          "on replica (u + t) % 2")
    rows, answers, ttfts, gaps = [], {}, {}, {}
    for sharing in (False, True):
        run = f"sharing {'on' if sharing else 'off'}"
        clear_store(a)
        cfg = engine_config(a, nb, sharing=sharing, min_share_tokens=a.share_min_tokens,
                            max_share_tokens=a.share_max_tokens if sharing else None)
        engines = [make_engine(a, cfg, a.executor == "cluster" or (a.executor == "auto" and a.device == "cuda"))
                   for _ in range(2)]
        row, answers[run], ttfts[run], gaps[run] = run_loop(a, run, engines, wl, lambda u, t: (u + t) % 2)
        rows.append(row | dict(sharing=sharing))
        free(*engines)
    clear_store(a)
    check = same_tokens(answers["sharing off"], answers["sharing on"], "[share] sharing off vs on",
                        *tie_args(a, gaps["sharing off"], gaps["sharing on"]))
    meta = dict(users=a.users, turns=a.turns, doc_tokens=a.doc_tokens, concurrency_per_replica=a.concurrency,
                num_blocks=nb, working_set_blocks=wl.working_blocks,
                kv_share_min_tokens=a.share_min_tokens if a.share_min_tokens is not None
                else CacheConfig().kv_share_min_tokens, kv_share_max_tokens=a.share_max_tokens, **check,
                ttft_s={k: [round(x, 5) for x in v] for k, v in ttfts.items()})
    return [r | {"part": "share"} for r in rows], meta


# ---------------------------------------------------------------------------- output
HOST_COLS = ["run", "num_blocks", "requests", "out_tok_s", "req_s", "cpu_s", "ttft_p50_s", "ttft_p99_s",
             "ttft_p50_later_turns_s", "hit_rate", "hit_tokens_device", "hit_tokens_host", "offloaded_MB",
             "onloaded_MB", "blocks_per_onload", "blocks_per_offload", "copy_s"]
SHARE_COLS = ["run", "num_blocks", "requests", "out_tok_s", "ttft_p50_s", "ttft_p99_s", "ttft_p50_later_turns_s",
              "hit_rate", "hit_tokens_device", "hit_tokens_shared", "published_MB", "fetched_MB", "copy_s"]
COPY_COLS = ["blocks", "bytes", "gather_GBps", "bare_out_GBps", "gather_frac_of_bare", "offload_frac_of_bare",
             "offload_device_frac_of_bare", "scatter_GBps", "bare_in_GBps", "scatter_frac_of_bare",
             "onload_frac_of_bare", "onload_device_frac_of_bare"]
BREAKEVEN_COLS = ["blocks", "tokens", "lookup_s", "get_s", "scatter_s", "fetch_s", "prefill_s", "fetch_wins",
                  "prefill_ttft_s", "fetched_ttft_s", "fetched_ttft_wins"]
COLS = {"host": HOST_COLS, "share": SHARE_COLS, "copy": COPY_COLS, "breakeven": BREAKEVEN_COLS}


def plot(data: dict, path: Path) -> None:
    from plotting import pyplot

    plt = pyplot()
    parts, rows = data.get("parts", {}), data.get("rows", [])
    panels = [p for p in PARTS if p in parts]
    cols = min(2, len(panels))
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6.4 * cols, 4.4 * nrows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, p in zip(axes.flat, panels):
        if p in ("host", "share"):
            for run, xs in parts[p]["ttft_s"].items():
                ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), drawstyle="steps-post",
                        label=f"{run} (p50 {np.median(xs):.3g} s)")
            ax.set_xscale("log")
            ax.set_xlabel("TTFT (s)")
            ax.set_ylabel("fraction of requests")
            what = ("host tier, device KV 1/%.1f of the working set" % parts[p]["working_set_over_cache"]
                    if p == "host" else "two replicas, turns alternating")
            ax.set_title(f"TTFT CDF: {what}", fontsize=10)
        elif p == "copy":
            rs = [r for r in rows if r["part"] == "copy"]
            xs = [r["blocks"] for r in rs]
            # offload = gather + into host slots, onload = from host slots + scatter: what a step pays
            # (a GPU's gather alone is a device-to-device copy, far above the link)
            for k, style, label in (("offload", "-o", "offload (device -> host tier)"), ("bare_out", "--o", "bare out"),
                                    ("onload", "-s", "onload (host tier -> device)"), ("bare_in", "--s", "bare in")):
                ax.plot(xs, [r[f"{k}_GBps"] for r in rs], style, label=label)
            if rs and "onload_device_s" in rs[0]:  # device time: the host issued the copies ahead
                for k, style in (("offload", ":o"), ("onload", ":s")):
                    ax.plot(xs, [r["bytes"] / r[f"{k}_device_s"] / 1e9 for r in rs], style,
                            label=f"{k}, device time")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("blocks copied")
            ax.set_ylabel("GB/s")
            ax.set_title(f"Tier copies vs bare copy ({parts[p]['block_bytes'] / 1024:.0f} KiB blocks)", fontsize=10)
        else:
            rs = [r for r in rows if r["part"] == "breakeven"]
            xs = [r["tokens"] for r in rs]
            ax.plot(xs, [r["fetch_s"] for r in rs], "-o", label="fetch (lookup + get + scatter)")
            ax.plot(xs, [max(r["prefill_s"], 1e-6) for r in rs], "-s", label="prefill (TTFT - 1-token TTFT)")
            ax.plot(xs, [r["fetched_ttft_s"] for r in rs], ":o", label="TTFT, fetched")
            ax.plot(xs, [r["prefill_ttft_s"] for r in rs], ":s", label="TTFT, computed")
            m = parts[p].get("measured_kv_share_min_tokens")
            if m:
                ax.axvline(m, color="grey", ls="--", label=f"fetch wins from {m} tokens")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("prefix tokens")
            ax.set_ylabel("seconds")
            ax.set_title("Shared fetch vs prefill", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    gpu = data.get("machine", {}).get("gpu") or f"{data.get('machine', {}).get('cpus')}-core CPU"
    fig.suptitle(f"KV tiers: {data.get('model_desc', data.get('model', ''))}, {gpu}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", default="all", help="comma-separated parts of " + ", ".join(PARTS) + " (default all)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=bl.device().type)
    ap.add_argument("--model", default=None, help="a preset (ray_attn/presets.py); default llama-3-8b on "
                    "cuda, else 'cpu' (a 4-layer 512-wide random model)")
    ap.add_argument("--tp", type=int, default=1, help="TP size (needs --executor cluster when > 1)")
    ap.add_argument("--executor", choices=["auto", "inprocess", "cluster"], default="auto",
                    help="auto: in the driver's process, except the share part on cuda (AttentionCluster, a "
                    "GPU per replica)")
    for k in DEFAULTS["cpu"]:
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=None, help=f"default: cpu "
                        f"{DEFAULTS['cpu'][k]}, cuda {DEFAULTS['cuda'][k]}")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=None, help="device KV blocks of the capped runs (default: "
                    "a third of the working set, at least what --concurrency requests need)")
    ap.add_argument("--fit-num-blocks", type=int, default=None, help="device KV blocks where the working set fits")
    ap.add_argument("--fit-users", type=int, default=None, help="users of the runs where the working set fits "
                    "(default: all on cpu; on cuda as many as the capped cache holds)")
    ap.add_argument("--fit-repeats", type=int, default=2, help="runs of each tier setting where it fits, in the "
                    "order off, on, on, off, ... (the best of each kept: a loaded box varies by several %%)")
    ap.add_argument("--host-gib", type=float, default=None, help="host tier per rank (default: 1.25x the working set)")
    ap.add_argument("--store-gib", type=float, default=None, help="each node's store (default: 1.25x the working set)")
    ap.add_argument("--share-min-tokens", type=int, default=None, help="kv_share_min_tokens of the share part "
                    "(default: CacheConfig's)")
    ap.add_argument("--share-max-tokens", type=int, default=None, help="kv_share_max_tokens of the share part "
                    "(default: none; on a GPU, breakeven's measured_kv_share_max_tokens)")
    ap.add_argument("--max-batched-tokens", type=int, default=None, help="default 2048 (cpu), 8192 (cuda)")
    ap.add_argument("--copy-blocks", default=None, help="block counts of the copy part (default cpu 1,4,16,64,256; "
                    "cuda 1,16,64,256,1024)")
    ap.add_argument("--iters", type=int, default=5, help="timed repeats of each copy")
    ap.add_argument("--breakeven-blocks", default=None, help="block counts of the breakeven part (default cpu "
                    "1,2,4,8,16,32,64; cuda up to 256)")
    ap.add_argument("--reps", type=int, default=3, help="repeats of each breakeven point (median)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (cpu)")
    ap.add_argument("--tie-margin", type=float, default=None,
                    help="nats: runs may fork only where both runs' top two logprobs are closer than this "
                    "(default: cuda 0.1, where bf16 results depend on the batch; cpu 0: identical tokens)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    ap.add_argument("--output", default=str(bl.RESULTS / "bench_kv_tiers.json"))
    a = ap.parse_args(argv)
    parts = list(PARTS) if a.part == "all" else [p.strip() for p in a.part.split(",")]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"--part: unknown {bad}; choose from {', '.join(PARTS)} or all")
    for k, v in DEFAULTS[a.device].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.model = a.model or ("llama-3-8b" if a.device == "cuda" else "cpu")
    a.tie_margin = (0.1 if a.device == "cuda" else 0.0) if a.tie_margin is None else a.tie_margin
    a.max_batched_tokens = a.max_batched_tokens or (8192 if a.device == "cuda" else 2048)
    a.copy_blocks = a.copy_blocks or ("1,16,64,256,1024" if a.device == "cuda" else "1,4,16,64,256")
    a.breakeven_blocks = a.breakeven_blocks or ("1,2,4,8,16,32,64" + (",128,256" if a.device == "cuda" else ""))
    if a.tp > 1 and a.executor != "cluster":
        ap.error("--tp > 1 needs --executor cluster")
    a.block_bytes = block_bytes(a)
    last = a.doc_tokens + a.turns * (a.question_tokens + a.answer_tokens)
    a.store_gib = a.store_gib or max(0.01, capped_gib(1.25 * a.users * math.ceil(last / a.block_size) * block_bytes(a),
                                                      "store"))

    if a.device == "cpu":  # OpenMP threads spin on a loaded box: 1 thread runs far faster there
        torch.set_num_threads(a.threads)
    out = Path(a.output)
    data = json.loads(out.read_text()) if out.exists() else {}
    if data.get("model") not in (None, a.model) or data.get("device") not in (None, a.device):
        data = {}  # another model's or device's results: start afresh
    data.update(machine=bl.machine(), model=a.model, device=a.device, model_desc=describe(a))
    data.setdefault("parts", {})
    runners = {"host": part_host, "share": part_share, "copy": part_copy, "breakeven": part_breakeven}
    for p in parts:
        if p == "share" and a.device == "cuda":
            measured_window(a, data["parts"].get("breakeven"))
        t0 = time.perf_counter()
        rows, meta = runners[p](a)
        meta["seconds"] = time.perf_counter() - t0
        data["parts"][p] = meta
        data["rows"] = [r for r in data.get("rows", []) if r["part"] != p] + rows
        bl.print_table(rows, COLS[p], title=f"{p} ({meta['seconds']:.0f} s)")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1, default=float) + "\n")  # after each part: nothing lost
    plot(data, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    # exact on CPU (float32); on a GPU forks only where both runs were within --tie-margin
    key = "forks_at_near_ties" if a.tie_margin else "tokens_identical"
    failed = [p for p in parts if data["parts"][p].get(key) is False]
    assert not failed, f"greedy tokens differ between the runs of {failed}" + (
        f" at a fork where a run's top two were {a.tie_margin} nats or more apart" if a.tie_margin else "")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
