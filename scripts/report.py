"""Markdown tables for the README from benchmarks/results/*.json (what the bench scripts wrote).

    python scripts/report.py > /tmp/perf.md
"""

from __future__ import annotations

import json
import re
from pathlib import Path

R = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def load(name):
    p = R / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def num(v) -> str:
    return f"{v:,.0f}"


def pct(v) -> str:
    return f"{v:.0%}"


def times(v) -> str:
    return f"{v:.2f}x"


def table(rows, cols, fmt=None):
    fmt = fmt or {}
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append("" if v is None else (fmt[c](v) if c in fmt else (f"{v:,.3g}" if isinstance(v, float) else str(v))))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def accuracy():
    """The "Correctness on GPU" table: one row per feature from scripts/gpu_accuracy.py."""
    runs = [r for r in (load("gpu_accuracy"), load("gpu_accuracy_tp2"), load("gpu_accuracy_fp8_weights"),
                                 load("gpu_accuracy_lora")) if r]
    if not runs:
        return
    rows = []
    for run in runs:
        for r in run["rows"]:
            st = r.get("stats", {})
            ran = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in st.items()
                            if k != "steps" and v and k in ("cascade_steps", "multi_group_cascade_steps",
                                                          "local_steps", "preemptions", "prefix_cache_hit_tokens",
                                                          "host_hit_blocks"))
            if r.get("lora_shift") is not None:
                ran = f"adapters moved agreement with the base model by {r['lora_shift']:.1f} points" + (
                    f", {ran}" if ran else "")
            if r.get("fp8_linears"):
                ran = f"e4m3 linears on rank 0: {r['fp8_linears']}" + (f", {ran}" if ran else "")
            rows.append(dict(row=r["row"], checks=r["what"], kernel=r.get("kernel"), graphs=r.get("cuda_graphs"),
                             **{"async": r.get("async_scheduling")}, agreement=r.get("agreement"),
                             control=r.get("control_fp8", r.get("control_bf16")), needs=r.get("threshold"),
                             evidence=ran or "", result="pass" if r["passed"] else f"FAIL {r.get('note', '')}"))
    run = runs[0]
    print(f"### Correctness on GPU ({run['device']}, {run['date']}, transformers {run['transformers']}; "
          "`python scripts/gpu_accuracy.py`)\n")
    pc = lambda v: f"{v:.1f}%"
    print(table(rows, ["row", "checks", "kernel", "graphs", "async", "agreement", "control", "needs", "evidence", "result"],
                {"agreement": pc, "control": pc, "needs": pc}))
    print()


SERVING_ROWS = ("random_rate_inf", "prefix_repetition_rate_inf", "random_rate_4", "random_rate_16",
                "random_rate_64", "random_concurrency_1")


def serving(paths=None):
    """The serving table from scripts/gpu_serving.py's ``serving_h200*.json``: one row per
    configuration and workload, the offline and decode measures, the goals, and others' published
    figures as context rows."""
    # the engine-thread suite's files only: _http (gpu_http_serving.py) and the _b{N} page-size
    # reruns have their own layout and place
    own = re.compile(r"serving_h200(?!.*_http)(?!_b\d+\.json).*\.json")
    paths = sorted(p for p in R.glob("serving_h200*.json") if own.fullmatch(p.name)) if paths is None else paths
    runs = [json.loads(Path(p).read_text()) for p in paths]
    if not runs:
        return
    ms = lambda v: f"{v:,.1f}"  # noqa: E731
    rows, other, goal_rows = [], [], []
    for run in runs:
        for conf in run["configs"]:
            w = conf["workloads"]
            for key in SERVING_ROWS + tuple(k for k in w if k.startswith("random_rate_16_budget_")):
                r = w.get(key) or {}
                if "request_throughput" not in r:
                    continue
                rows.append(dict(config=conf["name"], workload=key, prompts=r["completed"],
                                 req_s=r["request_throughput"], out_tok_s=r["output_throughput"],
                                 ttft_p50=r["median_ttft_ms"], ttft_p99=r["p99_ttft_ms"], tpot_p50=r["median_tpot_ms"],
                                 itl_p50=r["median_itl_ms"], itl_p99=r["p99_itl_ms"], of_roofline=r["frac_of_roofline"]))
            off = w.get("offline") or {}
            if "requests_per_second" in off:
                rows.append(dict(config=conf["name"], workload="offline (all at once)", prompts=off["num_requests"],
                                 req_s=off["requests_per_second"], out_tok_s=off["output_tokens_per_second"],
                                 of_roofline=off["frac_of_roofline"]))
            cp = w.get("chunked_prefill") or {}
            if "achieved_flops" in cp:
                other.append(dict(config=conf["name"], measure=f"chunked prefill, {cp['chunk_tokens']}-token steps",
                                  value=f"{cp['achieved_flops'] / 1e12:,.0f} TFLOP/s", of_bound=cp["frac_of_gemm"]))
            for key in sorted(k for k in w if k.startswith("decode_")):
                d = w[key]
                if "step_ms" in d:
                    other.append(dict(config=conf["name"], measure=f"decode {d['decode_batch']:.0f} x {d['ctx']}"
                                      + (" (TP=1)" if key.endswith("_tp1") else ""),
                                      value=f"{d['step_ms']:.2f} ms a step", of_bound=d["frac_of_mem_compute_roofline"]))
            for k, g in conf.get("goals", {}).items():
                goal_rows.append(dict(config=conf["name"], goal=k, value=g["value"], wanted=g["goal"],
                                      met="yes" if g["met"] else "**no**"))
    run = runs[0]
    dr = run["device_rates"]
    print(f"### Serving ({dr.get('gpu') or 'CPU'}, {run['preset']}, {run['date']}; `python scripts/gpu_serving.py`)\n")
    print(table(rows, ["config", "workload", "prompts", "req_s", "out_tok_s", "ttft_p50", "ttft_p99", "tpot_p50",
                       "itl_p50", "itl_p99", "of_roofline"],
                {"req_s": lambda v: f"{v:,.2f}", "out_tok_s": num, "ttft_p50": ms, "ttft_p99": ms, "tpot_p50": ms,
                 "itl_p50": ms, "itl_p99": ms, "of_roofline": pct}))
    print(f"\nLatencies in ms, timed as the engine loop pushes tokens (no HTTP). `of_roofline`: the "
          f"workload's roofline time over its measured time (copy {dr['copy_Bps'] / 1e9:,.0f} GB/s, GEMM "
          f"{dr['gemm_flops'] / 1e12:,.0f} TFLOP/s at the model's shapes, measured in the same run; "
          "scripts/servebench/roofline.py). At a finite rate the bound includes the arrivals.\n")
    if other:
        print(table(other, ["config", "measure", "value", "of_bound"], {"of_bound": pct}))
        print("\n`of_bound`: of the GEMM rate (prefill), of the memory+compute roofline (decode).\n")
    if goal_rows:
        print(table(goal_rows, ["config", "goal", "value", "wanted", "met"], {"value": lambda v: f"{v:.3f}"}))
        print()
    pub = run.get("published") or []
    if pub:
        print("Context only -- **others' numbers on other setups** (models, data, hardware differ), as published:\n")
        print(table(pub, ["source", "setup", "request_throughput", "output_throughput", "itl_ms"],
                    {"output_throughput": num}))
        print()
    cap = load("kv_capacity")
    if cap:
        print(f"KV capacity ({cap['num_requests']} x {cap['input_len']} + {cap['output_len']} tokens, "
              f"`python scripts/kv_capacity.py`): peak running **{cap['peak_running']}** of an ideal "
              f"{cap['ideal_requests']} ({num(cap['kv_bytes'] / 1e6)} MB of KV, {cap['num_blocks']} blocks), "
              f"{cap['preemptions']} preemptions"
              + (f"; the sizing before the profile step would have held {cap['legacy_ideal_requests']}."
                 if "legacy_ideal_requests" in cap else ".") + "\n")


def serving_http(suffix: str = ""):
    """The HTTP serving table (``scripts/gpu_http_serving.py``), with the script's own comparison
    (``vs_engine``) against the engine-thread run of the same workloads and prompts; after a new
    engine-thread run, ``gpu_http_serving.py --compare-only`` redoes it."""
    h = load("serving_h200_http" + suffix)
    if not h:
        return
    rows = []
    for key, r in h["workloads"].items():
        if "output_throughput" not in r:
            continue
        vs = r.get("vs_engine") or {}
        ratio = lambda m: (vs.get(m) or {}).get("ratio")  # noqa: E731
        ttft = vs.get("median_ttft_ms")
        rows.append(dict(workload=key, prompts=r["completed"], out_tok_s=r["output_throughput"],
                         vs_engine=ratio("output_throughput"), ttft_p50=r["median_ttft_ms"],
                         ttft_added=ttft["http"] - ttft["engine"] if ttft else None,
                         tpot_p50=r["median_tpot_ms"], tpot_vs_engine=ratio("median_tpot_ms"),
                         itl_p50=r["median_itl_ms"], itl_p99=r["p99_itl_ms"]))
    ms = lambda v: "" if v is None else f"{v:,.1f}"  # noqa: E731
    x = lambda v: "" if v is None else f"{v:.3f}x"  # noqa: E731
    print(f"### Serving over HTTP ({h['preset']}, {h['kv_cache_dtype']} KV, TP={h['tp']}, {h['date']}; "
          "`python scripts/gpu_http_serving.py`)\n")
    print(table(rows, ["workload", "prompts", "out_tok_s", "vs_engine", "ttft_p50", "ttft_added", "tpot_p50",
                       "tpot_vs_engine", "itl_p50", "itl_p99"],
                {"out_tok_s": num, "vs_engine": x, "ttft_p50": ms, "ttft_added": ms, "tpot_p50": ms,
                 "tpot_vs_engine": x, "itl_p50": ms, "itl_p99": ms}))
    print("\nStreamed `/v1/completions` through Ray Serve's proxy and our app, timed at the client "
          "(`bench_serve.py --backend openai`); `vs_engine` and `ttft_added` against the engine-thread "
          "run above (same prompts, its own engine).\n")


def moe():
    """The MoE section: one sparse layer's experts (grouped GEMM, loop, dense) and decode steps."""
    m = load("bench_moe")
    if not m:
        return
    print(f"### Mixture of experts ({m['machine'].get('gpu')}, {m['machine']['date']}, random weights of real shapes; "
          "`python scripts/bench_moe.py`)\n")
    us = lambda v: f"{v:,.0f}" if v >= 100 else f"{v:.1f}"
    ks = [r for r in m["rows"] if r["kind"] == "kernel"]
    print(table(ks, ["model", "tokens", "experts_hit", "grouped_graph_us", "small_graph_us", "loop_us", "dense_graph_us",
                     "roofline_us", "grouped_frac_of_roofline", "small_frac_of_roofline", "grouped_vs_loop"],
                {"grouped_graph_us": us, "small_graph_us": us, "loop_us": us, "dense_graph_us": us, "roofline_us": us,
                 "grouped_frac_of_roofline": pct, "small_frac_of_roofline": pct, "grouped_vs_loop": times}))
    print("\n`small`: the small-batch kernels (`model/moe_small.py`); `dense`: one dense GEMM pair of the same FLOPs; "
          f"`roofline`: the bytes of the experts hit at the copy rate ({m['rates']['copy_Bps'] / 1e9:,.0f} GB/s).\n")
    dec = [r for r in m["rows"] if r["kind"] == "decode"]
    print(table(dec, ["model", "moe_impl", "layers", "batch", "ctx", "experts_hit_per_layer", "graph_ms", "step_ms",
                      "roofline_ms", "frac_of_roofline"], {"frac_of_roofline": pct}))
    print()


def same_tokens_text(p: dict) -> str:
    """What a part's ``same_tokens`` check found (scripts/multiturn.py)."""
    n = f"{p['compared_requests']} requests, {p['compared_tokens']} tokens compared"
    if p["tokens_identical"]:
        return f"identical across the runs ({n})."
    if p.get("forks_at_near_ties"):
        return (f"{p['forks']} forks over the comparisons (a user's conversation, from its first differing token), "
                f"every one at a near-tie: both runs' top two "
                f"logprobs at most {max(p['fork_gaps']):.3f} nats apart (1-2 steps of bf16 logits; bf16 results "
                f"depend on the batch, and runs that differ only in the device cache's size fork the same way); "
                f"tokens identical up to each fork ({n}).")
    return f"**different** ({n})."


def kv_tiers(name: str = "bench_kv_tiers", cmd: str = "python scripts/bench_kv_tiers.py"):
    """The KV tiers section (issue 26) from scripts/bench_kv_tiers.py: the host tier on a multi-turn
    workload, two replicas sharing a store, the tiers' copies against a bare copy, and the shared
    fetch's break-even against prefill.  ``name``: the result file (the GPU run's is
    bench_kv_tiers_cuda)."""
    k = load(name)
    if not k:
        return
    parts, rows = k.get("parts", {}), k.get("rows", [])
    gpu = k["machine"].get("gpu") or f"{k['machine']['cpus']}-core CPU"
    print(f"### KV tiers ({gpu}, {k['machine']['date']}; {k.get('model_desc', k.get('model'))}; "
          f"`{cmd}`)\n")
    s = lambda v: f"{v:.3f}"  # noqa: E731
    mb = lambda v: f"{v:,.1f}"  # noqa: E731
    h = parts.get("host")
    if h:
        print(f"Host tier: {h['users']} users x {h['turns']} turns over {h['doc_tokens']}-token documents, "
              f"{h['concurrency']} in flight; device KV {h['num_blocks']} blocks, the working set "
              f"{h['working_set_over_cache']:.1f}x that; host tier {h['host_cache_gib']:.3g} GiB per rank.\n")
        print(table([r for r in rows if r["part"] == "host"],
                    ["run", "num_blocks", "out_tok_s", "req_s", "cpu_s", "ttft_p50_s", "ttft_p99_s",
                     "ttft_p50_later_turns_s", "hit_rate", "hit_tokens_device", "hit_tokens_host", "offloaded_MB",
                     "onloaded_MB", "copy_s"] + (["blocks_per_onload"] if any("blocks_per_onload" in r for r in rows) else []),
                    {"blocks_per_onload": lambda v: f"{v:,.0f}", "out_tok_s": num, "req_s": lambda v: f"{v:.2f}", "cpu_s": lambda v: f"{v:.1f}",
                     "ttft_p50_s": s, "ttft_p99_s": s, "ttft_p50_later_turns_s": s, "hit_rate": pct,
                     "offloaded_MB": mb, "onloaded_MB": mb, "copy_s": s}))
        cpu = h.get("fit_cpu_time_ratio")
        cpu = f"; CPU time tier off / on {cpu:.3f} (the ranks ran in the driver's process)" if cpu else ""
        by = {r["run"]: r for r in rows if r["part"] == "host"}
        off, on = by.get("capped, tier off"), by.get("capped, tier on")
        if off and on:
            print(f"\nCapped, tier on vs off: TTFT p50 {off['ttft_p50_s'] / on['ttft_p50_s']:.1f}x lower "
                  f"(goal >= 5x), p99 {off['ttft_p99_s'] / on['ttft_p99_s']:.2f}x, output throughput "
                  f"{on['out_tok_s'] / off['out_tok_s']:.2f}x.")
        print(f"\nGreedy tokens: {same_tokens_text(h)} Working set fits: throughput tier on / off "
              f"{h['fit_throughput_ratio']:.3f}, best of {h.get('fit_repeats', 1)} runs each (goal >= 0.98){cpu}.\n")
    sh = parts.get("share")
    if sh:
        print(f"Two replicas, turn t of user u on replica (u + t) % 2 ({sh['users']} users x {sh['turns']} turns, "
              f"{sh['concurrency_per_replica']} in flight per replica, {sh['num_blocks']} device blocks each, "
              f"kv_share_min_tokens {sh['kv_share_min_tokens']}"
              + (f", kv_share_max_tokens {sh['kv_share_max_tokens']}" if sh.get("kv_share_max_tokens") else "") + "):\n")
        print(table([r for r in rows if r["part"] == "share"],
                    ["run", "out_tok_s", "ttft_p50_s", "ttft_p99_s", "ttft_p50_later_turns_s", "hit_rate",
                     "hit_tokens_device", "hit_tokens_shared", "published_MB", "fetched_MB"],
                    {"out_tok_s": num, "ttft_p50_s": s, "ttft_p99_s": s, "ttft_p50_later_turns_s": s,
                     "hit_rate": pct, "published_MB": mb, "fetched_MB": mb}))
        print(f"\nGreedy tokens: {same_tokens_text(sh)}\n")
    c = [r for r in rows if r["part"] == "copy"]
    if c:
        bare = "pinned host <-> device" if parts["copy"]["pinned"] else "host tensor copy"
        print(f"Copies of n blocks ({parts['copy']['block_bytes'] / 1024:,.0f} KiB each) through RankKVTiers against a "
              f"bare copy of the same bytes ({bare}; goal on the H200: >= 80%):\n")
        gb = lambda v: f"{v:,.2f}"  # noqa: E731
        dev = ["offload_device_frac_of_bare", "onload_device_frac_of_bare"] if "onload_device_frac_of_bare" in c[0] else []
        print(table(c, ["blocks", "gather_GBps", "bare_out_GBps", "gather_frac_of_bare", "offload_frac_of_bare",
                        "scatter_GBps", "bare_in_GBps", "scatter_frac_of_bare", "onload_frac_of_bare"] + dev,
                    {"gather_GBps": gb, "bare_out_GBps": gb, "scatter_GBps": gb, "bare_in_GBps": gb,
                     "gather_frac_of_bare": pct, "offload_frac_of_bare": pct, "scatter_frac_of_bare": pct,
                     "onload_frac_of_bare": pct, **{k: pct for k in dev}}))
        if dev:
            print("\n`*_frac_of_bare`: wall time, the call and a synchronize (host time included); "
                  "`*_device_frac_of_bare`: device time from the first kernel or copy to the end of the "
                  "transfer, the host having issued it all ahead of the GPU as the engine does while the step "
                  "before computes (`device_span` in the script).")
        print()
    b = parts.get("breakeven")
    if b:
        timed = ("lookup", "get", "scatter", "fetch", "prefill", "prefill_ttft", "fetched_ttft")
        br = [{"tokens": r["tokens"], **{f"{c}_ms": r[f"{c}_s"] * 1e3 for c in timed}}
              for r in rows if r["part"] == "breakeven"]
        print("Shared fetch (lookup + get + scatter) vs prefill (TTFT with nothing cached less a 1-token prompt's); "
              f"median of {b['reps']}:\n")
        print(table(br, ["tokens"] + [f"{c}_ms" for c in timed], {f"{c}_ms": lambda v: f"{v:,.1f}" for c in timed}))
        def since(key, col):
            if b[key] is not None:
                return f"from {b[key]} tokens"
            wins = [r["tokens"] for r in rows if r["part"] == "breakeven" and r[col]]
            return (f"at no size from which it wins at every larger size measured (only at {wins} tokens)" if wins
                    else "at no size measured")
        print(f"\nFetching wins {since('measured_kv_share_min_tokens', 'fetch_wins')} (the measured "
              f"kv_share_min_tokens); end to end (TTFT fetched vs computed) "
              f"{since('measured_kv_share_min_tokens_end_to_end', 'fetched_ttft_wins')}"
              + (f"; fetching wins up to {b['measured_kv_share_max_tokens']} tokens (the measured kv_share_max_tokens)"
                 if b.get("measured_kv_share_max_tokens") else "") + ".\n")


def fp8_weights():
    """Issue 25: the serving goals (gpu_serving.py --weights bf16,fp8) and the per-shape kernels
    (bench_fp8.py: decode sizes from the run with the block-size sweep, prefill sizes from the last)."""
    srv, sweep, last = load("serving_h200_fp8_weights"), load("bench_fp8_sweep"), load("bench_fp8")
    if srv:
        print(f"### FP8 weights in the serving suite ({srv['device_rates'].get('gpu')}, {srv['date']}, "
              f"{srv['preset']}; `python scripts/gpu_serving.py --weights bf16,fp8 --kv-dtypes auto --only "
              "random_concurrency_1,offline,chunked_prefill,decode_256x1k`)\n")
        rows = []
        for c in srv["configs"]:
            w = c.get("workloads", {})
            g = lambda k, f: (w.get(k) or {}).get(f)  # noqa: E731
            rows.append(dict(engine=c["name"], weights=c.get("weights", "bf16"),
                             itl_c1_ms=g("random_concurrency_1", "median_itl_ms"),
                             offline_out_tok_s=g("offline", "output_tokens_per_second"),
                             prefill_frac_of_gemm=g("chunked_prefill", "frac_of_gemm"),
                             decode_256x1k_tok_s=g("decode_256x1k", "tok_s"),
                             decode_256x1k_frac=g("decode_256x1k", "frac_of_mem_compute_roofline")))
        print(table(rows, list(rows[0]), {"itl_c1_ms": lambda v: f"{v:.2f}", "prefill_frac_of_gemm": pct,
                                          "decode_256x1k_frac": pct}))
        print(f"\nGEMM rates at the model's shapes in the same run: bf16 {srv['device_rates']['gemm_flops'] / 1e12:,.0f}, "
              f"FP8 {srv['device_rates'].get('fp8_gemm_flops', 0) / 1e12:,.0f} TFLOP/s (each engine's prefill is held "
              "to its own).\n")
        goals = [dict(engine=n, goal=k, value=v["value"], wanted=v["goal"], met=v["met"])
                 for n, gs in srv.get("fp8_weights_goals", {}).items() for k, v in gs.items()]
        if goals:
            print(table(goals, ["engine", "goal", "value", "wanted", "met"], {"value": lambda v: f"{v:.3f}"}))
            print()
    for run, what, keep in ((sweep, "decode sizes, with the block-size sweep", lambda r: r["rows"] <= 64),
                            (last, "prefill sizes", lambda r: r["rows"] >= 256)):
        if not run:
            continue
        best = {(r["shape"], r["rows"]): r for r in run.get("sweep", []) if r.get("kernel") == "skinny"}
        rows = []
        for r in filter(keep, run["rows"]):
            sk = best.get((r["shape"], r["rows"]), {})
            rows.append(dict(shape=r["shape"], rows=r["rows"], bf16_us=r["bf16_us"], fp8_skinny_us=r.get("fp8_skinny_us"),
                             skinny_best_us=sk.get("best_us"), scaled_mm_us=r.get("fp8_scaled_mm_us"),
                             block_us=r.get("fp8_block_us"), pick=r["pick"],
                             fp8_frac_of_copy=sk.get("best_frac_of_copy") or r.get(f"fp8_{r['pick']}_frac_of_copy"),
                             fp8_frac_of_gemm=r.get("fp8_scaled_mm_frac_of_gemm") if r["rows"] >= 256 else None,
                             fp8_over_bf16=(sk.get("best_us") or r.get(f"fp8_{r['pick']}_us")) / r["bf16_us"]))
        m = run["machine"]
        print(f"FP8 linears against bf16, {what} ({m.get('gpu')}, {m['date']}; `python scripts/bench_fp8.py`; "
              "microseconds per layer, CUDA-graph replays over 32 layers' weights; copy "
              f"{run['rates']['copy_Bps'] / 1e9:,.0f} GB/s, FP8 GEMM {run['rates']['fp8_gemm_flops'] / 1e12:,.0f} "
              "TFLOP/s):\n")
        print(table(rows, list(rows[0]), {"fp8_frac_of_copy": pct, "fp8_frac_of_gemm": pct, "fp8_over_bf16": times,
                                          **{k: num for k in ("bf16_us", "fp8_skinny_us", "skinny_best_us",
                                                              "scaled_mm_us", "block_us")}}))
        print()


def main():
    accuracy()
    fp8_weights()
    moe()
    kv_tiers()
    kv_tiers("bench_kv_tiers_cuda", "python scripts/bench_kv_tiers.py --device cuda --part host --users 32 "
             "--turns 6 --concurrency 10 --fit-users 8 --fit-repeats 2`; `--part copy --iters 30`; `--part share --share-min-tokens 16 "
             "--executor inprocess --users 8 --turns 3 --doc-tokens 2048 --concurrency 4`; `--part breakeven")
    serving()
    serving_http()
    a = load("bench_attention")
    if a:
        m = a["machine"]
        print(f"### Attention step vs bare kernel ({m.get('gpu')}, {m['date']}; `python scripts/bench_attention.py`)\n")
        dec = [r for r in a["rows"] if r["mode"] == "decode" and r["batch"] >= 64]
        print(table(dec, ["kernel", "kv", "batch", "ctx", "ours_us", "bare_us", "overhead_pct", "ours_GBps", "frac_of_copy"],
                    {"ours_us": num, "bare_us": num, "overhead_pct": lambda v: f"{v:+.1f}%",
                     "ours_GBps": num, "frac_of_copy": pct}))
        print(f"\nDevice copy in the same run: {a['copy_GBps']:,.0f} GB/s (read + write). Batch 1-8 rows are in the JSON.\n")
        pages = [r for r in a["rows"] if r["mode"] == "decode-pages"]
        if pages:
            print("FA3 by page size, same run (bf16; `frac_of_copy` of our step and of the bare call):\n")
            print(table(pages, ["batch", "ctx", "block", "ours_us", "bare_us", "frac_of_copy", "bare_frac_of_copy"],
                        {"ours_us": num, "bare_us": num, "frac_of_copy": pct, "bare_frac_of_copy": pct}))
            print()
        pre = [r for r in a["rows"] if r["mode"] == "prefill"]
        print(table(pre, ["kernel", "ctx", "ours_us", "bare_us", "ours_TFLOPs", "bare_TFLOPs"],
                    {"ours_us": num, "bare_us": num}))
        print()
    c = load("bench_cascade")
    if c:
        print(f"### Cascade vs plain decode ({c['machine'].get('gpu')}, kernel {c['kernel']}; `python scripts/bench_cascade.py`)\n")
        rows = [r for r in c["rows"] if r["batch"] in (128, 256) or r["prefix"] in (8192,)]
        print(table(rows, ["prefix", "batch", "groups", "plain_us", "cascade_us", "speedup", "plain_graph_us",
                           "cascade_graph_us", "speedup_graph", "measured_policy_graph"],
                    {"plain_us": num, "cascade_us": num, "speedup": times, "plain_graph_us": num, "cascade_graph_us": num,
                     "speedup_graph": times}))
        print("\n`*_us`: launched eagerly, back to back (host launch cost included); `*_graph_us`: replayed from a "
              "CUDA graph, as the engine runs decode steps.\n")
        for sfx, what in (("", "eager"), ("_graph", "CUDA-graph")):
            if c.get(f"heuristic_right{sfx}") is None:
                continue
            print(f"- {what} times: vLLM's heuristic picks the faster path in {c[f'heuristic_right{sfx}']:.0%} of the "
                  f"{len(c['rows'])}-point grid (worst {c[f'worst_slowdown_when_picked{sfx}']:.2f}x of plain where it "
                  f"picks cascade); our measured policy in {c[f'measured_policy_right{sfx}']:.0%} (worst "
                  f"{c[f'measured_worst_slowdown_when_picked{sfx}']:.2f}x).")
        print()
        print(table(c["merge"], ["tokens", "torch_us", "dispatched_us", "dispatched_graph_us", "fused"]))
        print()
    for name, flag in (("bench_step_overhead", ""), ("bench_step_overhead_8b", " --model 8b")):
        s = load(name)
        if not s:
            continue
        print(f"### Step overhead, TP=1, batch {s['batch']}, {s['model']} model ({s['machine'].get('gpu')}; "
              f"`python scripts/bench_step_overhead.py{flag}`)\n")
        cols = ["path", "async_scheduling", "step_us", "step_p90_us", "plan_us", "call_us", "worker_us", "added_us"]
        print(table(s["rows"], cols, {k: num for k in cols[2:]}))
        print(f"\nPlan arrays to device: {s['plan_device_copy_us']:.0f} us.\n")
    e = load("bench_e2e")
    if e:
        print(f"### End-to-end decode, Llama-3-8B shape, bf16, one H200 (`python scripts/bench_e2e.py`)\n")
        print(table(e["rows"], ["batch", "ctx", "ours_tok_s", "ours_step_ms", "sync_step_ms", "roofline_step_ms",
                                "frac_of_roofline", "frac_of_mem_compute_roofline", "hf_tok_s", "hf_step_ms",
                                "speedup_vs_hf"],
                    {"ours_tok_s": num, "hf_tok_s": lambda v: num(v) if v > 0 else "n/a",
                     "frac_of_roofline": pct, "frac_of_mem_compute_roofline": pct,
                     "speedup_vs_hf": lambda v: times(v) if v > 0 else "n/a"}))
        gemm = f"; GEMM rate {e['matmul_TFLOPs']:,.0f} TFLOP/s" if e.get("matmul_TFLOPs") else ""
        print(f"\nWeights {e['weight_GB']:.1f} GB; copy bandwidth {e['copy_GBps']:,.0f} GB/s{gemm}; kernel {e['kernel']}. "
              "`ours_step_ms` runs with async scheduling, `sync_step_ms` without (same engine, same run).\n")
        print(table(e["shared_prompt"], ["workload", "cascade_enabled", "tok_s", "step_ms", "cascade_steps"],
                    {"tok_s": num}))
        print()
    t = load("bench_tp")
    if t:
        print(f"### Tensor parallel on {t['gpus']} GPUs (`python scripts/bench_tp.py`)\n")
        print(table(t["correctness"], ["tp", "same_as_tp1", "same_after_killed_rank", "recovery_s"]))
        print()
        print(table(t["rows"], ["tp", "batch", "ctx", "tok_s", "step_ms", "speedup", "efficiency", "resident_reqs", "preemptions", "allreduce_share", "attention_share"],
                    {"allreduce_share": pct, "attention_share": pct, "efficiency": pct,
                     "tok_s": num, "speedup": times}))
        if t.get("cuda_graphs") == "on":
            print(f"\nRun with `--cuda-graphs on`: TP>1 decode steps are captured too, NCCL all-reduce inside the "
                  "graph (since 2026-11-30 the default, `auto`, does the same). The correctness rows run float32 on the "
                  "torch kernel, which is never captured. `allreduce_share` and `attention_share` come from "
                  "the torch profiler's view of one step; for captured TP>1 steps they are not credible (99% "
                  "all-reduce at TP=2, batch 64).")
        else:
            print("\nTP=1 replays decode steps from CUDA graphs; TP>1 runs them eagerly (`cuda_graphs='auto'`), "
                  "so TP=2 is bound by kernel launches at batch 64.")
        print()
    p = load("bench_planner")
    if p:
        print(f"### Planner, one step ({p['meta']['cpus']}-core CPU; `python scripts/bench_planner.py`)\n")
        rows = [r for r in p["results"] if r["num_reqs"] in (8, 64, 256, 1024)]
        print(table(rows, ["num_reqs", "mixed", "cascade_groups", "local_attention", "median_us", "p90_us"],
                    {"median_us": num, "p90_us": num}))
        print()
    eo = load("bench_engine_overhead")
    if eo:
        print(f"### Engine host time per decode step, no model ({eo['machine']['cpus']}-core CPU; `python scripts/bench_engine_overhead.py`)\n")
        print(table(eo["rows"], ["batch", "ctx", "step_us", "p90_us"],
                    {"step_us": num, "p90_us": num}))
        print()
    lt = load("load_test")
    if lt:
        print(f"### Load test (`python scripts/load_test.py --clients {lt['clients']} --duration {lt['duration_s']:.0f}`)\n")
        keys = ["requests_completed", "errors", "latency_p50_s", "latency_p99_s", "tokens_per_s", "mean_batch_size", "kv_blocks_used_at_end", "leaked_blocks"]
        print(table([lt], keys))


if __name__ == "__main__":
    main()
