"""scripts/gpu_serving.py and scripts/kv_capacity.py on CPU, at a tiny scale: every workload of
the suite runs through one engine and lands in the JSON with vLLM's keys, its roofline and the
goals; the README table renders from it; the capacity script counts what its cache holds.

Timings are not asserted (a busy CPU box); the figures' identities are."""

from __future__ import annotations

import importlib
import json
import math
import sys
from fractions import Fraction
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

# Written out here, not imported from the script, so that a workload dropped from the suite fails.
SERVING = ["random_rate_inf", "prefix_repetition_rate_inf", "random_rate_4", "random_rate_16", "random_rate_64",
           "random_concurrency_1", "random_rate_16_budget_2048", "random_rate_16_budget_4096"]
OTHER = ["offline", "chunked_prefill", "decode_256x1k", "decode_64x4k", "kv_capacity"]
VLLM_SUMMARY = {"duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                "request_throughput", "output_throughput", "total_token_throughput", "max_concurrent_requests",
                "request_rate", "max_concurrency", "num_prompts"} | {
    f"{s}_{m}_ms" for s in ("mean", "median", "std", "p99") for m in ("ttft", "tpot", "itl", "e2el")}
ROOFLINE = {"roofline_s", "work_s", "arrival_bound_s", "prefill_s", "prefill_flops", "prefill_tokens", "decode_s",
            "decode_steps", "decode_tokens", "max_batch", "roofline_output_throughput"}
GOALS = {"offline_frac_of_roofline", "itl_c1_over_roofline", "chunked_prefill_frac_of_gemm",
         "decode_256x1k_frac_of_mem_compute_roofline"}


def run(script: str, *args) -> None:
    """The script's main in this process, on the run's Ray (``shared_ray``): a subprocess would
    import torch and start a Ray of its own first (~10 s on two cores)."""
    module = importlib.import_module(Path(script).stem)
    assert module.main([str(a) for a in args]) == 0


@pytest.fixture(scope="module")
def suite(tmp_path_factory, shared_ray):
    out = tmp_path_factory.mktemp("serving")
    mirror = tmp_path_factory.mktemp("mirror")
    # Every count at its floor (--scale 0.005: 2 prompts a workload, 5 at rate inf, 10 prefix
    # repetitions); kv_capacity at 2 x (496 + 16) tokens instead of 2 x (3967 + 128): its figures
    # are tested on their own below, here it must run and land in the JSON and the mirror.  The
    # .png is drawn once, at the end, not after each workload.  The engine's rank runs in this
    # process (--executor in_process): what is tested here is the script's records, and a Ray
    # rank's per-step round trip made the 13 workloads ~2x slower on two cores (Ray ranks are
    # the runtime tests' subject).
    run("scripts/gpu_serving.py", "--preset", "tiny", "--device", "cpu", "--scale", "0.005", "--num-blocks", 2048,
        "--executor", "in_process",
        "--budget-sweep", "2048,4096", "--capacity-input-len", 496, "--capacity-output-len", 16, "--final-plot-only",
        "--kv-dtypes", "auto", "--result-dir", out, "--mirror-dir", mirror)
    return out, mirror, json.loads((out / "serving_h200_cpu.json").read_text())


def test_every_workload_ran_with_vllm_keys_and_its_roofline(suite):
    out, mirror, r = suite
    assert [c["name"] for c in r["configs"]] == ["bf16"]
    w = r["configs"][0]["workloads"]
    missing = [k for k in SERVING + OTHER if k not in w or "skipped" in w[k]]
    assert not missing, f"workloads skipped or missing: {missing}"
    for key in SERVING:
        rec = w[key]
        assert VLLM_SUMMARY <= rec.keys(), (key, VLLM_SUMMARY - rec.keys())
        assert rec["completed"] == rec["num_prompts"] > 0 and rec["failed"] == 0 and rec["num_errors"] == 0
        assert not {"ttfts", "itls", "input_lens"} & rec.keys()  # per-request lists stay out
        assert ROOFLINE <= rec["roofline"].keys()
        roof = rec["roofline"]
        assert rec["frac_of_roofline"] == pytest.approx(roof["roofline_s"] / rec["duration"], rel=1e-12)
        assert roof["roofline_s"] == max(roof["work_s"], roof["arrival_bound_s"]) > 0
        assert roof["decode_tokens"] == rec["total_output_tokens"] - rec["completed"]
        if key.startswith("random"):  # each workload has prompts of its own: no hit on an earlier one's
            assert rec["engine_stats"]["prefix_cache_hit_tokens"] == 0, key
        # this run's share of the engine's counters (CPU: no async step computing an extra token)
        assert rec["engine_stats"]["tokens_generated"] == rec["total_output_tokens"]
    for rate in (4, 16, 64):
        rec = w[f"random_rate_{rate}"]
        assert rec["request_rate"] == rate and rec["roofline"]["arrival_bound_s"] > rec["num_prompts"] / rate
    assert w["random_rate_inf"]["roofline"]["arrival_bound_s"] == 0
    c1 = w["random_concurrency_1"]
    assert c1["max_concurrency"] == 1 and c1["roofline"]["max_batch"] == 1
    assert c1["median_itl_over_roofline"] == pytest.approx(c1["median_itl_ms"] / c1["itl_roofline_ms"])
    # prefix_repetition: the ideal cache computes each prefix once
    pr = w["prefix_repetition_rate_inf"]
    assert pr["roofline"]["prefill_tokens"] < pr["total_input_tokens"]
    assert w["random_rate_16_budget_2048"]["max_num_batched_tokens"] == 2048
    assert (out / "serving_h200_cpu.png").stat().st_size > 10_000
    assert {p.name for p in mirror.iterdir()} >= {"serving_h200_cpu.json", "serving_h200_cpu.png", "kv_capacity.json"}


def test_offline_prefill_decode_capacity_and_goals(suite):
    out, _, r = suite
    conf = r["configs"][0]
    w = conf["workloads"]
    off = w["offline"]
    for k in ("elapsed_time", "num_requests", "total_num_tokens", "requests_per_second", "tokens_per_second"):
        assert k in off  # vllm bench throughput's keys
    assert off["engine_stats"]["prefix_cache_hit_tokens"] == 0
    assert off["errors"] == 0 and off["frac_of_roofline"] == pytest.approx(off["roofline"]["roofline_s"] / off["elapsed_time"])
    cp = w["chunked_prefill"]
    assert cp["chunk_tokens"] == 8192 and cp["total_output_tokens"] == cp["num_requests"]
    assert cp["frac_of_gemm"] == pytest.approx(cp["prefill_flops"] / cp["elapsed_time"] / r["device_rates"]["gemm_flops"])
    for key in ("decode_256x1k", "decode_64x4k"):
        d = w[key]
        assert d["decode_batch"] == d["batch"] and d["frac_of_mem_compute_roofline"] > 0
        assert d["mem_compute_roofline_step_ms"] >= d["roofline_step_ms"] * (1 - 1e-12)
    cap = w["kv_capacity"]
    assert cap == json.loads((out / "kv_capacity.json").read_text())
    assert 1 <= cap["peak_running"] <= cap["num_requests"]
    assert (cap["input_len"], cap["output_len"]) == (496, 16)  # the flags reached the workload
    assert set(conf["goals"]) == GOALS
    for g in conf["goals"].values():
        assert {"value", "goal", "met"} <= g.keys()
    assert {p["source"] for p in r["published"]} == {"vLLM PR #8804", "NVIDIA NIM", "TensorRT-LLM"}
    for key in ("copy_Bps", "gemm_flops", "gemm_shapes"):
        assert key in r["device_rates"]


def test_report_renders_the_serving_table(suite, monkeypatch, capsys):
    out, _, _ = suite
    import report

    monkeypatch.setattr(report, "R", out)
    report.serving()
    text = capsys.readouterr().out
    assert "### Serving" in text and "others' numbers on other setups" in text
    for key in SERVING + ["offline (all at once)", "vLLM PR #8804", "chunked prefill", "KV capacity"]:
        assert key in text, key


def test_kv_capacity_counts_residents_against_the_ideal(tmp_path, shared_ray):
    # 120-token requests in 16-token blocks: 8 blocks each; 30 blocks hold 3 in whole blocks, 4 by
    # bytes; 6 requests then must preempt as they grow.
    out = tmp_path / "cap.json"
    run("scripts/kv_capacity.py", "--preset", "tiny", "--device", "cpu", "--num-blocks", 30, "--num-requests", 6,
        "--input-len", 100, "--output-len", 20, "--json", out)
    r = json.loads(out.read_text())
    per_token = 2 * 2 * 2 * 64 * 4  # K and V, 2 layers, 2 KV heads of 64, float32
    assert r["kv_bytes_per_token"] == per_token and r["kv_bytes"] == 30 * 16 * per_token
    assert r["ideal_requests"] == 4 and r["ideal_requests_in_blocks"] == 3
    assert 3 <= r["peak_running"] <= 4 and r["preemptions"] >= 1 and r["peak_used_blocks"] <= 30
    assert r["memory"] == [None]  # a fixed cache on CPU: nothing was sized


def test_ideal_requests_against_exact_division():
    from kv_capacity import ideal_requests

    for kv, tokens, per, bs in ((108_859_849_113, 4224, 131072, 16), (1 << 30, 1000, 65536, 16), (10, 3, 1, 16)):
        r = ideal_requests(kv, tokens, per, bs)
        assert r["ideal_requests"] == math.floor(Fraction(kv, tokens * per))
        assert r["ideal_requests_in_blocks"] == math.floor(Fraction(kv, math.ceil(tokens / bs) * bs * per))
    with pytest.raises(ValueError, match="tokens_per_request"):
        ideal_requests(1, 0, 1, 16)


def test_a_passed_deadline_marks_what_it_skipped(tmp_path, shared_ray):
    run("scripts/gpu_serving.py", "--preset", "tiny", "--device", "cpu", "--kv-dtypes", "auto,fp8",
        "--deadline-s", 0, "--result-dir", tmp_path)
    r = json.loads((tmp_path / "serving_h200_cpu.json").read_text())
    assert [(c["name"], c["skipped"]) for c in r["configs"]] == [("bf16", "--deadline-s 0.0 passed"),
                                                                   ("fp8", "--deadline-s 0.0 passed")]


def test_fp8_weight_goals_compare_with_the_bf16_engine_of_the_same_kv_dtype():
    """Issue 25's goals: ratios against the bf16-weight engine with the same KV dtype, <= for the
    ITL ones and >= for the rest; an engine without a bf16 partner gets only its own fractions."""
    from servebench.targets import fp8_weights_goals

    def conf(name, weights, kv, itl, tput, frac_itl=1.0):
        return dict(name=name, weights=weights, kv_cache_dtype=kv, workloads={
            "random_concurrency_1": dict(median_itl_ms=itl, median_itl_over_roofline=frac_itl),
            "offline": dict(output_tokens_per_second=tput), "chunked_prefill": dict(frac_of_gemm=0.71),
            "decode_256x1k": dict(frac_of_mem_compute_roofline=0.79)})

    goals = fp8_weights_goals([conf("bf16", "bf16", "auto", 5.0, 1000.0), conf("fp8w_bf16", "fp8", "auto", 3.0, 1400.0, 1.3),
                               conf("fp8w_fp8", "fp8", "fp8", 2.0, 2000.0, 1.2)])
    g = goals["fp8w_bf16"]
    assert g["itl_c1_vs_bf16"] == dict(value=0.6, goal=0.6, met=True)
    assert g["offline_throughput_vs_bf16"]["met"] and abs(g["offline_throughput_vs_bf16"]["value"] - 1.4) < 1e-12
    assert not g["itl_c1_over_roofline"]["met"]  # 1.3 > 1.25
    assert g["chunked_prefill_frac_of_fp8_gemm"]["met"] and not g["decode_256x1k_frac_of_mem_compute_roofline"]["met"]
    assert "itl_c1_vs_bf16" not in goals["fp8w_fp8"] and goals["fp8w_fp8"]["itl_c1_over_roofline"]["met"]
