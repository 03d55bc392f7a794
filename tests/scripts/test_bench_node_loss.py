"""scripts/bench_node_loss.py at a tiny setting (a head and 2 worker nodes, 3 clients, 6 s of
load): the head's front replica is SIGKILLed under streams, every client reconnects, and the
row reports what the script measures -- no request lost, none duplicated, the hit streams
resumed.  About 40 s (its own simulated cluster: the script's, started and stopped by it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.timescale import scaled

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def test_losing_the_heads_front_loses_no_request_that_reconnects(tmp_path):
    from tests.serve.conftest import free_port

    out = tmp_path / "bench_node_loss.json"
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_node_loss.py"), "--nodes", "2",
                        "--replicas-per-node", "1", "--clients", "3", "--duration", "6", "--loss-at", "2.5",
                        "--losses", "head-front", "--no-plot", "--port", str(free_port()), "--output", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=scaled(300))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["loss"] == "head-front" and row["requests"] >= 3
    assert row["requests_lost"] == 0, row["lost_examples"]
    assert row["tokens_duplicated"] == 0 and row["tokens_missing"] == 0
    assert row["completed_as_fault_free"] == row["requests"]
    assert row["requests_resumed"] >= row["streams_hit"] >= 1, row
