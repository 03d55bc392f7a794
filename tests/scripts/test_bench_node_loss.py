"""scripts/bench_node_loss.py at a tiny setting (a head and 1 worker node of ``ray start``: a
front and a proxy on each, the one engine replica on the worker; 3 clients, 6 s of load): the
head node itself is lost under streams -- its raylet, the GCS, Serve's controller, its proxy and
front -- and a head is started again 2 s later over the GCS's RocksDB tables; every client
reconnects through the worker's proxy and front, and the row reports what the script measures --
no request lost, none duplicated, the hit streams resumed.  The loss waits
(``--loss-wait-for-hit``) until a stream runs through the head's front, so that it always hits
one; the fault-free answers are asked 3 at a time (``--check-clients``).  The head's front
replica lost alone is tested in tests/cluster (``test_a_front_replica_killed_mid_stream...``).
About 45 s (its own cluster: the script's, started and stopped by it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.timescale import scaled

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def test_losing_the_head_node_loses_no_request_that_reconnects(tmp_path):
    from tests.serve.conftest import free_port

    out = tmp_path / "bench_node_loss.json"
    # The load's times stretch with the machine's slowness (a CPU hog: streams start later and the
    # loss must still find one on the head's front).
    load = {"--duration": scaled(6), "--loss-at": scaled(2), "--loss-wait-for-hit": scaled(2.5)}
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_node_loss.py"), "--nodes", "1",
                        "--replicas-per-node", "1", "--clients", "3",
                        *[x for k, v in load.items() for x in (k, f"{v:.1f}")],
                        "--check-clients", "3", "--losses", "head-node", "--no-plot",
                        "--port", str(free_port()), "--output", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=scaled(300))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["loss"] == "head-node" and row["requests"] >= 3
    assert row["requests_lost"] == 0, row["lost_examples"]
    assert row["tokens_duplicated"] == 0 and row["tokens_missing"] == 0
    assert row["completed_as_fault_free"] == row["requests"]
    # every stream live on the head's front (with most of its tokens to come) when it was killed
    # went on through the other one -- but one that ended before the front was dead
    assert row["streams_hit_resumed"] >= 1, row
    assert row["streams_hit_resumed"] + row["streams_hit_ended_first"] == row["streams_hit"], row
    assert row["requests_resumed"] >= row["streams_hit_resumed"], row
