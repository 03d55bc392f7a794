"""scripts/gpu_http_serving.py end to end on CPU: the Serve app on a tiny model, two workloads over
HTTP with vLLM's keys, each set against an engine-thread result of the same workload, and the
README table that report.py makes of it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.serve.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

pytestmark = pytest.mark.slow
WORKLOADS = ["random_concurrency_1", "random_rate_16"]


@pytest.fixture(scope="module")
def http_run(tmp_path_factory, shared_ray):
    out = tmp_path_factory.mktemp("http")
    # An engine-thread result to compare with: gpu_serving.py's layout, numbers chosen here.
    engine = {"configs": [{"name": "bf16", "workloads": {
        "random_concurrency_1": {"median_itl_ms": 2.0, "median_ttft_ms": 10.0, "p99_ttft_ms": 20.0,
                                 "median_tpot_ms": 2.0, "p99_itl_ms": 4.0, "output_throughput": 100.0}}}]}
    (out / "serving_h200_cpu.json").write_text(json.dumps(engine))
    # The script's main on the run's Ray, which it leaves up (a subprocess starts a Ray first: ~10 s)
    import gpu_http_serving

    # The replica's rank in the replica (--executor in_process): the HTTP path is the subject here.
    assert gpu_http_serving.main(["--preset", "tiny", "--device", "cpu", "--scale", "0.01", "--num-blocks", "2048",
                                  "--executor", "in_process",
                                  "--only", ",".join(WORKLOADS), "--warmup-prompts", "1", "--port", str(free_port()),
                                  "--result-dir", str(out)]) == 0
    return out, json.loads((out / "serving_h200_http_cpu.json").read_text())


def test_workloads_ran_over_http_against_the_engine_run(http_run):
    _, res = http_run
    assert list(res["workloads"]) == WORKLOADS
    for key, rec in res["workloads"].items():
        assert rec["transport"] == "http" and rec["backend"] == "openai"
        assert rec["completed"] == rec["num_prompts"] > 0 and rec["failed"] == 0 and rec["num_errors"] == 0
        assert rec["median_itl_ms"] > 0 and rec["median_ttft_ms"] > 0
    c1 = res["workloads"]["random_concurrency_1"]
    assert c1["max_concurrency"] == 1
    vs = c1["vs_engine"]["median_itl_ms"]
    assert vs["engine"] == 2.0 and vs["ratio"] == pytest.approx(c1["median_itl_ms"] / 2.0)
    assert res["workloads"]["random_rate_16"]["vs_engine"] == {}  # no engine-thread record of it


def test_report_renders_the_http_table(http_run, monkeypatch, capsys):
    out, res = http_run
    import report

    monkeypatch.setattr(report, "R", out)
    report.serving_http("_cpu")
    text = capsys.readouterr().out
    assert "### Serving over HTTP" in text
    row = next(line for line in text.splitlines() if line.startswith("| random_concurrency_1 "))
    added = res["workloads"]["random_concurrency_1"]["median_ttft_ms"] - 10.0
    assert f"{added:,.1f}" in row  # ttft_added against the engine record
