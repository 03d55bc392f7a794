"""scripts/bench_serve.py and bench_throughput.py: vLLM's serving metrics from a fake OpenAI server
with known delays, the in-process engine backend, and the offline throughput benchmark.

The delay checks test the SSE parser and the metric definitions, not performance: lower bounds are
what the fake sleeps, upper bounds generous; identities between the metrics (E2EL = TTFT + the
ITLs) are checked exactly.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_serve  # noqa: E402
import bench_throughput  # noqa: E402
from servebench import datasets, driver, metrics  # noqa: E402
from servebench.openai_client import SSEDecoder  # noqa: E402
from tests.scripts.fake_openai import FakeOpenAI, Plan  # noqa: E402

VLLM_KEYS = {"duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
             "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
             "input_lens", "output_lens", "ttfts", "itls", "errors", "date", "backend", "model_id",
             "num_prompts", "request_rate", "burstiness", "max_concurrency"} | {
    f"{s}_{m}_ms" for s in ("mean", "median", "std", "p99") for m in ("ttft", "tpot", "itl", "e2el")}
SLACK = 5.0  # upper bounds only catch a wrong unit or a summed-up gap, not slowness: a busy CI box may stall for seconds


def serve(url: str, *extra, ready_check: float = 0) -> dict:
    args = bench_serve.parser().parse_args(
        ["--base-url", url, "--disable-tqdm", "--ready-check-timeout-sec", str(ready_check), *map(str, extra)])
    return asyncio.run(bench_serve.benchmark(args))


# ------------------------------------------------------------------------------- over HTTP
def test_metrics_follow_the_fake_servers_delays(tmp_path):
    first, gap, n_out, n = 0.15, 0.03, 5, 6
    with FakeOpenAI(plan=lambda body: Plan(first, gap), vocab_size=50) as fake:
        r = serve(fake.url, "--num-prompts", n, "--random-input-len", 12, "--random-output-len", n_out,
                  "--max-concurrency", 3, "--save-result", "--result-dir", tmp_path,
                  "--result-filename", "out.json", ready_check=5)
        assert len(fake.bodies) == n + 1  # the ready check's request, then the run's
    assert VLLM_KEYS <= r.keys() and r["backend"] == "openai" and r["transport"] == "http"
    assert json.loads((tmp_path / "out.json").read_text())["completed"] == n
    assert r["completed"] == n and r["failed"] == 0 and r["errors"] == [""] * n
    # the last chunk holds two tokens: the count comes from usage, and there are n_out - 2 gaps
    assert r["output_lens"] == [n_out] * n and r["total_output_tokens"] == n * n_out
    assert r["input_lens"] == [12] * n and r["total_input_tokens"] == 12 * n
    for ttft, itl in zip(r["ttfts"], r["itls"]):
        assert first <= ttft < first + SLACK
        assert len(itl) == n_out - 2 and all(x < gap + SLACK for x in itl)
        # Each gap only from above: a chunk read late on a loaded machine lengthens its own gap
        # and shortens the next (26.5 ms after 35.2 in a CI run, against 30 sent).  Their sum
        # can't shrink: the last chunk leaves the server after the first delay and every gap.
        assert ttft + sum(itl) >= 0.99 * (first + (n_out - 2) * gap)
    e2el = np.array([t + sum(i) for t, i in zip(r["ttfts"], r["itls"])])
    tpot = (e2el - np.array(r["ttfts"])) / (n_out - 1)
    for name, ref in (("ttft", np.array(r["ttfts"])), ("e2el", e2el), ("tpot", tpot),
                      ("itl", np.concatenate(r["itls"]))):
        assert r[f"mean_{name}_ms"] == pytest.approx(ref.mean() * 1000, rel=1e-9)
        assert r[f"median_{name}_ms"] == pytest.approx(np.median(ref) * 1000, rel=1e-9)
        assert r[f"p99_{name}_ms"] == pytest.approx(np.percentile(ref, 99) * 1000, rel=1e-9)
    assert r["request_throughput"] == pytest.approx(n / r["duration"])
    assert r["model_id"] == "fake-model" and r["vocab_size"] == 50  # from GET /v1/models
    for body in fake.bodies:
        assert body["model"] == "fake-model" and body["stream"] is True and body["temperature"] == 0.0
        assert body["stream_options"] == {"include_usage": True} and body["max_tokens"] == n_out
        assert body["ignore_eos"] is True  # forced for the random dataset, as vLLM does
        assert len(body["prompt"]) == 12 and all(0 <= t < 50 for t in body["prompt"])


def test_goodput_counts_requests_within_every_slo():
    # Prompts starting with an odd token id get their first token after 1.5 s, the others at once
    # (a 1 s SLO leaves a loaded machine a second of slack either way).
    def plan(body):
        return Plan(1.5 if body["prompt"][0] % 2 else 0.0, 0.0)

    with FakeOpenAI(plan=plan) as fake:
        r = serve(fake.url, "--num-prompts", 12, "--random-input-len", 4, "--random-output-len", 3,
                  "--goodput", "ttft:1000", "e2el:5000")
        fast = sum(b["prompt"][0] % 2 == 0 for b in fake.bodies)
    assert 0 < fast < 12
    assert r["request_goodput"] * r["duration"] == pytest.approx(fast)
    assert r["goodput"] == {"ttft": 1000.0, "e2el": 5000.0}


@pytest.mark.parametrize("max_concurrency,expect", [(None, 8), (3, 3), (1, 1)])
def test_rate_inf_sends_at_once_and_max_concurrency_bounds_in_flight(max_concurrency, expect):
    with FakeOpenAI(plan=lambda body: Plan(0.25, 0.0)) as fake:
        extra = [] if max_concurrency is None else ["--max-concurrency", max_concurrency]
        r = serve(fake.url, "--num-prompts", 8, "--random-input-len", 4, "--random-output-len", 2, *extra)
        assert fake.max_in_flight == expect
    assert r["completed"] == 8


def test_failed_requests_are_counted_and_do_not_stop_the_run():
    def plan(body):
        return Plan(0.0, 0.0, status=500 if body["prompt"][0] % 3 == 0 else 200)

    with FakeOpenAI(plan=plan) as fake:
        r = serve(fake.url, "--num-prompts", 12, "--random-input-len", 4, "--random-output-len", 3,
                  "--goodput", "ttft:10000")
        bad = [b["prompt"][0] % 3 == 0 for b in fake.bodies]
    assert 0 < sum(bad) < 12
    assert r["failed"] == sum(bad) and r["completed"] == 12 - sum(bad)
    assert sum("HTTP 500" in e for e in r["errors"]) == sum(bad)
    assert sorted(r["output_lens"]) == [0] * sum(bad) + [3] * (12 - sum(bad))
    assert r["request_goodput"] * r["duration"] == pytest.approx(12 - sum(bad))


def test_ready_check_that_never_succeeds_stops_the_run(capsys):
    with FakeOpenAI(plan=lambda body: Plan(status=503)) as fake:
        rc = bench_serve.main(["--base-url", fake.url, "--ready-check-timeout-sec", "0.3", "--num-prompts", "2",
                               "--random-input-len", "4", "--random-output-len", "2", "--disable-tqdm"])
        assert len(fake.bodies) >= 1
    assert rc == 1 and "initial test run failed: HTTP 503" in capsys.readouterr().err


def test_unreachable_server_fails_every_request_without_raising():
    with FakeOpenAI() as fake:
        url = fake.url
    r = serve(url, "--num-prompts", 3, "--random-input-len", 4, "--random-output-len", 2,
              "--model", "m", "--vocab-size", 10)
    assert r["completed"] == 0 and r["failed"] == 3 and all(r["errors"])


# ------------------------------------------------------------------------------- units
def test_calculate_metrics_against_a_float64_reference():
    rng = np.random.default_rng(7)
    outs = []
    for i in range(40):
        n = int(rng.integers(1, 6))
        itl = rng.uniform(0.001, 0.05, max(n - 1, 0)).tolist()
        ttft = float(rng.uniform(0.01, 0.3))
        outs.append(metrics.RequestFuncOutput(success=i % 7 != 3, ttft=ttft, itl=itl, output_tokens=n,
                                              latency=ttft + sum(itl), prompt_len=int(rng.integers(1, 99)),
                                              start_time=float(rng.uniform(0, 2))))
    slo = {"ttft": 150.0, "tpot": 30.0}
    m, lens = metrics.calculate_metrics(outs, 2.5, [50.0, 90.0], slo)
    ok = [o for o in outs if o.success]
    assert lens == [o.output_tokens if o.success else 0 for o in outs]
    assert m.completed == len(ok) and m.failed == len(outs) - len(ok)
    tpot_all = [(o.latency - o.ttft) / (o.output_tokens - 1) if o.output_tokens > 1 else 0.0 for o in ok]
    good = sum(o.ttft <= 0.150 and t <= 0.030 for o, t in zip(ok, tpot_all))
    assert m.request_goodput == pytest.approx(good / 2.5, abs=1e-12)
    refs = {"ttft": [o.ttft for o in ok], "e2el": [o.latency for o in ok],
            "itl": [x for o in ok for x in o.itl],
            "tpot": [t for o, t in zip(ok, tpot_all) if o.output_tokens > 1]}
    for name, xs in refs.items():
        a = np.asarray(xs, np.float64) * 1000
        s = m.stats_ms[name]
        assert s["mean"] == pytest.approx(a.mean(), rel=1e-12) and s["std"] == pytest.approx(a.std(), rel=1e-12)
        assert s["percentiles"] == [(p, pytest.approx(np.percentile(a, p), rel=1e-12)) for p in (50.0, 90.0)]
    assert m.total_output == sum(o.output_tokens for o in ok)
    assert m.total_token_throughput == pytest.approx((sum(o.prompt_len for o in ok) + m.total_output) / 2.5)


def test_percentile_keys_are_named_as_vllm():
    out = metrics.RequestFuncOutput(success=True, ttft=0.1, itl=[0.01], output_tokens=2, latency=0.11)
    m, lens = metrics.calculate_metrics([out], 1.0, [50.0, 99.9], {})
    res, table = metrics.benchmark_result(m, lens, [out], 1.0, ["ttft", "itl"], {}, float("inf"), None)
    assert {"p50_ttft_ms", "p99.9_ttft_ms", "p50_itl_ms", "p99.9_itl_ms"} <= res.keys()
    assert "p50_tpot_ms" not in res and res["request_goodput"] is None
    assert "P99.9 TTFT (ms):" in table and "Serving Benchmark Result" in table


def test_arrival_schedule():
    rng = np.random.default_rng(0)
    assert driver.arrival_offsets(5, float("inf"), 1.0, rng) == [0.0] * 5
    for burst in (0.2, 1.0, 50.0):
        t = np.array(driver.arrival_offsets(4000, 20.0, burst, np.random.default_rng(1)))
        assert t[-1] == pytest.approx(4000 / 20.0) and np.all(np.diff(t) >= 0)
        gaps = np.diff(t)
        # gamma gaps: coefficient of variation 1/sqrt(shape)
        assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burst), rel=0.1)
    with pytest.raises(ValueError, match="--burstiness"):
        driver.arrival_offsets(3, 1.0, 0.0, rng)


def test_sse_decoder():
    d = SSEDecoder()
    got = [d.feed(x) for x in [": ping\n", "\n", "data: {\"a\":\r\n", "data: 1}\r\n", "\r\n", "event: x\n",
                               "data:[DONE]\n", "\n"]]
    assert [g for g in got if g is not None] == ['{"a":\n1}', "[DONE]"]


def test_datasets_lengths_prefixes_and_bounds():
    rng = np.random.default_rng(3)
    reqs = datasets.random_requests(rng, 100, 50, 20, 10, range_ratio=0.5, prefix_len=7)
    assert all(10 <= r.prompt_len - 7 <= 30 and 5 <= r.expected_output_len <= 15 for r in reqs)
    assert len({tuple(r.prompt[:7]) for r in reqs}) == 1 and all(r.prompt_len == len(r.prompt) for r in reqs)
    reqs = datasets.prefix_repetition_requests(rng, 100, 11, 8, 4, 3, 6)
    assert len(reqs) == 11 and sorted(np.unique([tuple(r.prompt[:8]) for r in reqs], axis=0,
                                                return_counts=True)[1].tolist()) == [3, 4, 4]
    reqs = datasets.sharegpt_like_requests(rng, 100, 500)
    ins = np.array([r.prompt_len for r in reqs])
    outs = np.array([r.expected_output_len for r in reqs])
    assert ins.min() >= 4 and outs.min() >= 4 and ins.max() <= 1024 and (ins + outs).max() <= 2048
    assert 100 < ins.mean() < 220 and 220 < outs.mean() < 420  # near ShareGPT's 161 / 338


@pytest.mark.parametrize("argv,needle", [
    (["--random-range-ratio", "1.0"], "--random-range-ratio"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--max-concurrency", "0"], "--max-concurrency"),
    (["--request-rate", "0"], "--request-rate"),
    (["--goodput", "ttft=3"], "--goodput"),
    (["--goodput", "itl:3"], "--goodput"),
    (["--metric-percentiles", "0"], "--metric-percentiles"),
    (["--percentile-metrics", "ttft,foo"], "--percentile-metrics"),
    (["--backend", "engine"], "--engine-config"),
    (["--backend", "engine", "--model", "nope"], "--engine-config"),
    (["--backend", "engine", "--model", "tiny", "--executor", "in_process", "--tp", "2"], "--tp"),
])
def test_bad_arguments_name_the_flag(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        bench_serve.main(["--vocab-size", "10", "--model", "m", "--disable-tqdm", *argv])
    assert e.value.code == 2 and needle in capsys.readouterr().err


# ------------------------------------------------------------------------------- in process
TINY = ["--executor", "in_process", "--device", "cpu", "--num-blocks", "128"]


def test_engine_backend_produces_vllm_json_and_the_engines_tokens():
    args = bench_serve.parser().parse_args(
        ["--backend", "engine", "--model", "tiny", *TINY, "--num-prompts", "5", "--random-input-len", "20",
         "--random-output-len", "4", "--random-range-ratio", "0.5", "--request-rate", "50",
         "--goodput", "e2el:100000", "--disable-tqdm"])
    r = asyncio.run(bench_serve.benchmark(args))
    assert VLLM_KEYS <= r.keys() and r["backend"] == "engine" and r["transport"] == "in_process"
    assert r["completed"] == 5 and r["failed"] == 0 and r["request_goodput"] * r["duration"] == pytest.approx(5)
    samples = datasets.get_samples(args, 512)
    assert r["output_lens"] == [s.expected_output_len for s in samples]
    assert r["input_lens"] == [s.prompt_len for s in samples]
    assert [len(i) for i in r["itls"]] == [s.expected_output_len - 1 for s in samples]
    e2el = [t + sum(i) for t, i in zip(r["ttfts"], r["itls"])]  # the last token's time, by definition
    assert r["mean_e2el_ms"] == pytest.approx(np.mean(e2el) * 1000, rel=1e-9)
    assert r["engine_stats"]["tokens_generated"] == sum(r["output_lens"])
    assert r["engine_config"]["model"]["vocab_size"] == 512 and r["request_rate"] == 50.0

    # The transport returns exactly the engine's greedy tokens.
    from ray_attn.request import SamplingParams
    from servebench.engine_transport import EngineTransport, load_engine_config, make_engine

    cfg = load_engine_config("tiny", {"parallel.device": "cpu", "cache.num_blocks": 128})
    ref = make_engine(cfg, "in_process").generate(
        [s.prompt for s in samples], [SamplingParams(max_tokens=s.expected_output_len) for s in samples])
    t = EngineTransport(make_engine(cfg, "in_process"), 8, ignore_eos=True)
    try:
        outs, _ = asyncio.run(driver.run_requests(t.send, samples, float("inf"), 1.0, 2,
                                                  np.random.default_rng(0), True))
    finally:
        t.close()
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in ref]


def test_engine_backend_counts_requests_the_engine_rejects():
    # 2 blocks of 16 tokens cannot hold a 40-token prompt: the engine refuses each request.
    args = bench_serve.parser().parse_args(
        ["--backend", "engine", "--model", "tiny", *TINY[:-1], "2", "--num-prompts", "3",
         "--random-input-len", "40", "--random-output-len", "2", "--disable-tqdm"])
    r = asyncio.run(bench_serve.benchmark(args))
    assert r["completed"] == 0 and r["failed"] == 3
    assert all(e.startswith("rejected: request needs") for e in r["errors"])


def test_bench_throughput_reports_vllm_keys_and_engine_stats(tmp_path):
    out = tmp_path / "tp.json"
    rc = bench_throughput.main(["--model-preset", "tiny", *TINY, "--max-num-seqs", "3",
                                "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "64",
                                "--prefix-repetition-suffix-len", "8", "--prefix-repetition-num-prefixes", "2",
                                "--output-len", "5", "--num-prompts", "8", "--output-json", str(out),
                                "--disable-tqdm"])
    r = json.loads(out.read_text())
    assert rc == 0 and r["num_requests"] == 8 and r["errors"] == []
    assert r["total_num_tokens"] == 8 * (64 + 8) + 8 * 5 and r["total_output_tokens"] == 40
    assert r["requests_per_second"] == pytest.approx(8 / r["elapsed_time"])
    assert r["tokens_per_second"] == pytest.approx(r["total_num_tokens"] / r["elapsed_time"])
    assert r["output_tokens_per_second"] == pytest.approx(40 / r["elapsed_time"])
    assert r["peak_running_requests"] == 3  # max_num_seqs caps it
    # later requests find their prefix's 4 full blocks cached
    assert r["engine_stats"]["prefix_cache_hit_tokens"] >= 64 * (8 - 2 * 3) // 2
    assert r["engine_stats"]["tokens_generated"] == 40
