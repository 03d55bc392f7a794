#!/usr/bin/env python
"""The serving workloads over HTTP: our Serve app (``ray_attn.serve.app:build_app``: proxy, replica,
engine, Ray worker actors, CUDA graphs, async scheduling) measured by ``bench_serve.py`` the way
``vllm bench serve`` measures a server -- streamed ``/v1/completions``, TTFT and ITL taken at the
client.  ``gpu_serving.py`` times the same workloads (same seeds, so the same prompts) on the
engine thread; the ratio of the two is what HTTP, Serve's proxy, JSON and the OpenAI layer add.

    python scripts/gpu_http_serving.py                      # GPU: Llama-3-8B shape, bf16 KV, TP=1
    python scripts/gpu_http_serving.py --preset tiny --device cpu --scale 0.02 --num-blocks 2048

The GPU machine has no fastapi/uvicorn: stage them once with ``scripts/device/stage_serve.sh``
and ``source .device/serve_env.sh`` there.  Writes benchmarks/results/serving_h200_http{suffix}.json.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import bench_serve  # noqa: E402
from gpu_serving import LISTS, RESULTS, args_for, serving_workloads, workload_seed  # noqa: E402

# Most wanted first: concurrency 1 is the ITL the issue sets against the roofline.
ORDER = ("random_concurrency_1", "random_rate_4", "random_rate_16", "random_rate_64", "random_rate_inf",
         "prefix_repetition_rate_inf")
COMPARED = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "median_itl_ms", "p99_itl_ms",
            "output_throughput")


def app_args(a, queue: int) -> dict:
    from ray_attn.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig

    cfg = EngineConfig(model=ModelConfig.from_name(a.preset),
                       cache=CacheConfig(kv_cache_dtype=a.kv_cache_dtype, num_blocks=a.num_blocks),
                       parallel=ParallelConfig(tensor_parallel_size=a.tp, device=a.device,
                                               use_compiled_graph=a.device == "cuda"),
                       max_num_seqs=256, max_num_batched_tokens=8192)
    # The admission bounds sized for the largest workload (1,000 prompts at once): the front
    # would answer the surplus 503, which measures the front, not the engine.
    return dict(engine=cfg.model_dump(mode="json"), executor=a.executor, served_model_name=a.preset,
                use_gpu=a.device == "cuda", max_prompt_tokens=8192, max_tokens_limit=2048,
                max_queue_depth=queue, max_connections=queue + 512,
                max_requests_per_client=queue + 512, max_queued_requests=queue,
                replica_num_cpus=1, step_timeout_s=600.0)


def compare(rec: dict, engine_rec: dict | None) -> dict:
    if not engine_rec or "median_itl_ms" not in engine_rec:
        return {}
    return {k: dict(http=rec[k], engine=engine_rec[k], ratio=rec[k] / engine_rec[k] if engine_rec[k] else None)
            for k in COMPARED if k in rec and k in engine_rec}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default=None, help="model preset (default: llama-3-8b on GPU, tiny on CPU)")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--executor", choices=["ray", "in_process"], default="ray",
                   help="the replica's ranks as Ray actors (the default, as served) or in the replica (TP=1)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"])
    p.add_argument("--num-blocks", type=int, default=None, help="fix the KV cache (default: sized from memory)")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies every prompt count")
    p.add_argument("--seed", type=int, default=0, help="as gpu_serving.py's --seed (same prompts)")
    p.add_argument("--only", default=None, help="comma-separated workload names (default: all)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--warmup-prompts", type=int, default=8,
                   help="requests at concurrency 1 before the workloads (graph capture, warm pools)")
    p.add_argument("--engine-results", default=None,
                   help="gpu_serving.py's JSON to compare with (default: serving_h200{suffix}.json)")
    p.add_argument("--suffix", default=None, help="result file suffix (default: _tp{N} for TP > 1, _cpu on CPU)")
    p.add_argument("--result-dir", default=str(RESULTS))
    p.add_argument("--mirror-dir", default=None, help="also copy the result here after each workload ($OUT)")
    p.add_argument("--deadline-s", type=float, default=None, help="start no workload after this many seconds")
    p.add_argument("--compare-only", default=None, metavar="JSON",
                   help="run nothing: redo this HTTP result's vs_engine against --engine-results")
    a = p.parse_args(argv)
    import torch

    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    a.preset = a.preset or ("llama-3-8b" if a.device == "cuda" else "tiny")
    if a.suffix is None:
        a.suffix = f"_tp{a.tp}" if a.tp > 1 else ("_cpu" if a.device == "cpu" else "")
    works = serving_workloads(a.scale)
    names = [n for n in ORDER if not a.only or n in a.only.split(",")]
    engine_path = Path(a.engine_results or Path(a.result_dir) / f"serving_h200{a.suffix}.json")
    engine_runs = {}
    if engine_path.exists():
        kv = {"auto": "bf16"}.get(a.kv_cache_dtype, a.kv_cache_dtype) + (f"_tp{a.tp}" if a.tp > 1 else "")
        conf = next((c for c in json.loads(engine_path.read_text())["configs"] if c["name"] == kv), {})
        engine_runs = conf.get("workloads", {})
    if a.compare_only:
        path = Path(a.compare_only)
        res = json.loads(path.read_text())
        for name, rec in res["workloads"].items():
            if "median_itl_ms" in rec:
                rec["vs_engine"] = compare(rec, engine_runs.get(name))
        res["engine_results"] = str(engine_path) if engine_runs else None
        path.write_text(json.dumps(res, indent=1, default=float) + "\n")
        print(f"updated {path} against {engine_path}")
        return 0
    out_path = Path(a.result_dir) / f"serving_h200_http{a.suffix}.json"
    out = dict(date=datetime.date.today().isoformat(), preset=a.preset, tp=a.tp, kv_cache_dtype=a.kv_cache_dtype,
               scale=a.scale, transport="http (Ray Serve proxy -> ray_attn.serve.app replica)",
               engine_results=str(engine_path) if engine_runs else None, workloads={})

    def save():
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(out, indent=1, default=float) + "\n")
        if a.mirror_dir:
            shutil.copy(out_path, a.mirror_dir)

    import ray
    from ray import serve

    from ray_attn.serve.app import build_app

    os.environ["PYTHONPATH"] = os.pathsep.join(x for x in [str(REPO), os.environ.get("PYTHONPATH", "")] if x)
    started = not ray.is_initialized()  # called in-process with a Ray up (the tests): used, left up
    if started:
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
    t0 = time.perf_counter()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": a.port})
        serve.run(build_app(app_args(a, 1024)), name="ray_attn", route_prefix="/", blocking=False)
        out["startup_s"] = time.perf_counter() - t0
        print(f"Serve app up in {out['startup_s']:.0f} s on port {a.port}")
        base = f"http://127.0.0.1:{a.port}"
        warm = dataclasses.replace(works["random_concurrency_1"], num_prompts=a.warmup_prompts)
        wargs = args_for(warm, a.preset, workload_seed(a.seed, "http_warmup"), ("--backend", "openai", "--base-url", base))
        asyncio.run(bench_serve.benchmark(wargs))  # first requests: graph capture done, pools warm
        for name in names:
            if a.deadline_s is not None and time.perf_counter() - t0 > a.deadline_s:
                out["workloads"][name] = dict(skipped=f"--deadline-s {a.deadline_s} passed")
                continue
            w = works[name]
            args = args_for(w, a.preset, workload_seed(a.seed, name), ("--backend", "openai", "--base-url", base))
            t = time.perf_counter()
            r = asyncio.run(bench_serve.benchmark(args))
            errors = [e for e in r["errors"] if e]
            rec = {k: v for k, v in r.items() if k not in LISTS + ("args", "server_info")}
            rec.update(num_errors=len(errors), first_error=errors[0] if errors else None,
                       wall_s=time.perf_counter() - t, vs_engine=compare(rec, engine_runs.get(name)))
            out["workloads"][name] = rec
            save()
            vs = rec["vs_engine"].get("median_itl_ms", {}).get("ratio")
            print(f"--- {name}: {rec['completed']} done, ITL p50 {rec['median_itl_ms']:.2f} ms, TTFT p50 "
                  f"{rec['median_ttft_ms']:.1f} ms" + (f", ITL {vs:.3f}x the engine thread's" if vs else ""))
    finally:
        out["total_s"] = time.perf_counter() - t0
        save()
        serve.shutdown()
        if started:
            ray.shutdown()
    print(f"wrote {out_path}")
    return 0 if all(not w.get("num_errors") for w in out["workloads"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
