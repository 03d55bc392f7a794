"""Markdown tables for the README from benchmarks/results/*.json (what the bench scripts wrote).

    python scripts/report.py > /tmp/perf.md
"""

from __future__ import annotations

import json
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
    runs = [r for r in (load("gpu_accuracy"), load("gpu_accuracy_tp2")) if r]
    if not runs:
        return
    rows = []
    for run in runs:
        for r in run["rows"]:
            st = r.get("stats", {})
            ran = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in st.items()
                            if k != "steps" and v and k in ("cascade_steps", "multi_group_cascade_steps",
                                                          "local_steps", "preemptions", "prefix_cache_hit_tokens"))
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


def main():
    accuracy()
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
