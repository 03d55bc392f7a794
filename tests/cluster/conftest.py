"""The simulated multi-node cluster of ``scripts/simcluster.py`` for these tests, and their time
limit.  One cluster serves every module here (``sim_cluster``): starting one (a head and two
worker raylets) costs 10-20 s on two cores.  A test that removes worker nodes leaves the rest;
the next user gets the worker nodes it asks for added back.  None uses ``ray stop``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from simcluster import (  # noqa: E402
    FRONT_RESOURCE, alive_named_actors, REPLICA_RESOURCE, SimCluster, replica_actors, replica_nodes, start_cluster, stop_cluster,
    wait_replicas)

__all__ = ["FRONT_RESOURCE", "alive_named_actors", "REPLICA_RESOURCE", "SimCluster", "replica_actors", "replica_nodes", "start_cluster",
           "stop_cluster", "wait_replicas", "REPLICA_CPUS", "FRONT_CPUS", "start_serve"]

# Each worker node's CPUs: one TP=2 Serve replica (its bundle + 0.5 per rank), or one batch
# engine replica of 1 CPU.  The replica resource (one unit per node) keeps it to one replica.
REPLICA_CPUS = 2.0
# and room for one front replica (the Serve tests spread the front over every node)
FRONT_CPUS = 1.0  # (a node's CPUs are whole numbers)


class SharedSim:
    """The package's one SimCluster, started on first use, torn down with the package."""

    def __init__(self):
        self.sim: SimCluster | None = None
        self.gcs_storage_path: str | None = None
        self.restore_shared_ray = False

    def get(self, workers: int = 2, gcs_storage_path: str | None = None) -> SimCluster:
        """The cluster with (at least) ``workers`` worker nodes alive; ``gcs_storage_path``: its
        GCS's tables on disk there (``simcluster.start_cluster``) -- a cluster started without it
        is replaced."""
        if self.sim is not None and self.gcs_storage_path != gcs_storage_path:
            self.discard()
        if self.sim is None:
            from tests import shared_ray

            # The run's local Ray is shut down for it (one Ray per driver), and started again after.
            if shared_ray.is_ours():
                shared_ray.shutdown()
                self.restore_shared_ray = True
            self.sim = start_cluster(num_replica_nodes=workers, replica_cpus=REPLICA_CPUS, front_cpus=FRONT_CPUS,
                                     gcs_storage_path=gcs_storage_path)
            self.gcs_storage_path = gcs_storage_path
        while len(self.sim.workers) < workers:
            self.sim.add_replica_node()
        return self.sim

    def discard(self) -> None:
        """Stop the cluster outright (``stop_cluster``: every process of every node killed,
        Serve's with them, no graceful wait -- over 20 s once the nodes of some replicas are gone
        and Serve retries their replacements)."""
        if self.sim is not None:
            sim, self.sim = self.sim, None
            stop_cluster(sim)


def start_serve(proxy_location: str = "HeadOnly") -> int:
    """Serve on the cluster, its proxies on loopback at a free port (returned): the head's alone
    (``HeadOnly``) or on every node with a replica (``EveryNode``; the simulated nodes all listen
    on 127.0.0.1 and share the port)."""
    from ray import serve

    from tests.serve.conftest import free_port

    port = free_port()
    serve.start(proxy_location=proxy_location, http_options={"host": "127.0.0.1", "port": port})
    return port


@pytest.fixture(scope="package")
def sim_cluster():
    shared = SharedSim()
    try:
        yield shared
    finally:
        shared.discard()
        if shared.restore_shared_ray:
            from tests import shared_ray

            shared_ray.ensure()


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
