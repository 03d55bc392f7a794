"""scripts/load_test.py against the live Serve app: bounded, stops by itself, reports, no leaks."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.serve.conftest import LIMITS, MAX_NUM_SEQS
from tests.timescale import scaled

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "load_test.py"


def test_load_test_reports_zero_errors_and_zero_leaked_blocks(served, tmp_path):
    out = tmp_path / "load_test.json"
    clients = MAX_NUM_SEQS + LIMITS["max_queue_depth"] + 4  # more than the replica holds: some 503s
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--url", served.url, "--clients", str(clients), "--duration", "6",
         "--max-tokens", "12", "--prompt-len", "24", "--request-timeout", str(scaled(30)),
         "--drain-timeout", str(scaled(15)),
         "--out", str(out), "--check"],
        capture_output=True, text=True, timeout=scaled(90))
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    print("\n" + proc.stdout)
    assert wall < scaled(60), "the load test must stop by itself"
    assert report["errors"] == 0, report["error_samples"]
    assert report["requests_completed"] > 0 and report["tokens_per_s"] > 0
    assert report["rejected_503"] > 0, "more clients than capacity: the queue limit must answer 503"
    assert report["in_flight_at_end"] == 0 and report["leaked_blocks"] == 0
    assert report["latency_p50_s"] <= report["latency_p99_s"]
    assert report["mean_batch_size"] > 1
