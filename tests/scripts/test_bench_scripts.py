"""The benchmark scripts' offline paths run on CPU: re-scoring, re-plotting, reporting, and the
engine-overhead benchmark at a tiny size (the GPU grids themselves run on the GPU machine)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.timescale import scaled

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def run(*args, cwd=ROOT):
    r = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=scaled(300))
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_cascade_rescore_and_e2e_replot_on_saved_runs(tmp_path):
    casc = tmp_path / "bench_cascade.json"
    shutil.copy(RESULTS / "bench_cascade.json", casc)
    out = run("scripts/bench_cascade.py", "--rescore", str(casc))
    saved = json.loads(casc.read_text())
    assert f"measured policy right {saved['measured_policy_right']:.0%}" in out
    assert all("measured_right" in r for r in saved["rows"])
    e2e = tmp_path / "bench_e2e.json"
    shutil.copy(RESULTS / "bench_e2e.json", e2e)
    run("scripts/bench_e2e.py", "--replot", str(e2e))
    assert e2e.with_suffix(".png").stat().st_size > 10_000


def test_report_renders_every_saved_result():
    out = run("scripts/report.py")
    for heading in ("Attention step vs bare kernel", "Cascade vs plain decode", "Step overhead",
                    "End-to-end decode", "Planner, one step"):
        assert heading in out


def test_engine_overhead_benchmark_runs(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "scripts"))
    import benchlib

    monkeypatch.setattr(benchlib, "RESULTS", tmp_path)
    import bench_engine_overhead

    bench_engine_overhead.main(["--batch", "8", "--ctx", "64", "--steps", "5"])
    rows = json.loads((tmp_path / "bench_engine_overhead.json").read_text())["rows"]
    assert rows[0]["batch"] == 8 and rows[0]["step_us"] > 0


def test_cascade_benchmark_cpu_path_with_split_sweep(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "scripts"))
    import benchlib

    monkeypatch.setattr(benchlib, "RESULTS", tmp_path)
    import bench_cascade

    bench_cascade.main(["--prefixes", "256", "--batches", "8,16", "--groups", "1,4",
                        "--prefix-splits", "0,4", "--iters", "1"])
    saved = json.loads((tmp_path / "bench_cascade.json").read_text())
    rows = saved["rows"]
    assert [(r["batch"], r["groups"]) for r in rows] == [(8, 1), (8, 4), (16, 1), (16, 4)]
    for r in rows:
        assert r["plain_us"] > 0 and r["cascade_host_us"] > 0 and r["speedup"] > 0
        assert r["plain_graph_us"] is None and r["speedup_graph"] is None  # no graphs on CPU
        assert set(r["cascade_us_by_splits"]) == {"0", "4"} and r["best_splits"] in (0, 4)
        assert r["best_by"] == "eager" and "measured_right" in r
    assert saved["prefix_splits"] == [0, 4] and "measured_policy_right_graph" not in saved
    assert (tmp_path / "bench_cascade.png").stat().st_size > 10_000


def test_timing_helpers_on_cpu():
    sys.path.insert(0, str(ROOT / "scripts"))
    import benchlib

    calls = []
    assert benchlib.graph_timeit(lambda: calls.append(1)) is None  # nothing to capture on CPU
    assert calls == [] and benchlib.host_timeit(lambda: calls.append(1), burst=3, reps=2) >= 0
    assert len(calls) == 1 + 3 * 2


def test_start_decoding_starts_a_batch_that_fits_and_names_one_the_cache_cannot_hold_at_once():
    """A decode point whose batch the KV cache cannot hold all at once used to step until the
    first requests ended, or for ever (profile_decode's 256 x 1k at half an 80 GB card); now
    ``start_decoding`` raises and names the batch."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import benchlib
    from ray_attn.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
    from ray_attn.engine import LLMEngine, SamplingParams
    from ray_attn.runtime import InProcessExecutor

    # 8 blocks of 16 tokens: one request of 100 + 20 tokens at a time (it takes them all)
    cfg = EngineConfig(model=ModelConfig.from_name("tiny"), cache=CacheConfig(num_blocks=8, block_size=16),
                       parallel=ParallelConfig(device="cpu"), max_num_seqs=4, max_num_batched_tokens=128)
    eng = LLMEngine(cfg, InProcessExecutor(cfg))
    try:
        ids = benchlib.start_decoding(eng, [[1] * 20, [2] * 20], [SamplingParams(max_tokens=100)] * 2)
        assert all(eng.requests[i].num_output_tokens for i in ids)
        benchlib.end_requests(eng, ids)
        with pytest.raises(RuntimeError, match="4 requests of up to 100 tokens did not all start"):
            benchlib.start_decoding(eng, [[3 + i] * 100 for i in range(4)],  # distinct: no prefix shared
                                    [SamplingParams(max_tokens=20, ignore_eos=True)] * 4)
    finally:
        eng.shutdown()


def test_moe_benchmark_cpu_path(tmp_path, monkeypatch):
    """bench_moe on the tiny stand-ins: every row measured, the experts hit counted from the step's
    own routing (k at batch 1, more for a batch), the roofline below the measured time."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import benchlib

    monkeypatch.setattr(benchlib, "RESULTS", tmp_path)
    import bench_moe

    bench_moe.main(["--batches", "1,4", "--tokens", "1,8", "--ctx", "32", "--iters", "1"])
    rows = json.loads((tmp_path / "bench_moe.json").read_text())["rows"]
    kernel = [r for r in rows if r["kind"] == "kernel"]
    decode = [r for r in rows if r["kind"] == "decode"]
    assert [(r["model"], r["tokens"]) for r in kernel] == [(m, t) for m in ("tiny-qwen3-moe", "tiny-llama4")
                                                           for t in (1, 8)]
    for r in kernel:
        assert r["grouped_us"] > 0 and r["loop_us"] > 0 and r["dense_us"] > 0 and r["roofline_us"] > 0
        assert r["top_k"] <= r["experts_hit"] <= min(r["experts"], r["tokens"] * r["top_k"])
        assert r["small_us"] is None  # the small-batch kernels are measured on GPUs only
    for r in decode:
        assert r["step_ms"] > r["roofline_ms"] > 0 and r["graph_ms"] is None and r["moe_impl"] == "auto"
        k = {"tiny-qwen3-moe": 4, "tiny-llama4": 1}[r["model"]]
        assert (r["experts_hit_per_layer"] == k) if r["batch"] == 1 else (r["experts_hit_per_layer"] >= k)
    assert (tmp_path / "bench_moe.png").stat().st_size > 10_000
