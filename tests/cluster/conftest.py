"""The simulated multi-node cluster of ``scripts/simcluster.py`` for these tests, and their time
limit.  Every test here starts and stops its own cluster; none uses ``ray stop``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from simcluster import (  # noqa: E402
    FRONT_RESOURCE, REPLICA_RESOURCE, SimCluster, replica_nodes, start_cluster, stop_cluster, wait_replicas)

__all__ = ["FRONT_RESOURCE", "REPLICA_RESOURCE", "SimCluster", "replica_nodes", "start_cluster",
           "stop_cluster", "wait_replicas"]


@pytest.fixture
def time_limit():
    """The test ends within its limit, whatever hangs (SIGALRM in the main thread)."""
    import signal

    def arm(seconds: float):
        def expire(signum, frame):
            raise TimeoutError(f"test ran past {seconds:.0f}s")

        signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, seconds)

    old = signal.getsignal(signal.SIGALRM)
    yield arm
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)
