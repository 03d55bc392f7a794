"""A multi-node Ray cluster on one machine, the way Ray's own tests build one
(``ray.cluster_utils.Cluster``: a head raylet and worker raylets, each with its own CPUs and
custom resources), for ``tests/cluster`` and ``scripts/bench_node_loss.py``.  Started and torn
down by its user -- never ``ray stop``.

The head holds Serve's controller, its one HTTP proxy (``HeadOnly``: several proxies on one
machine would want one port) and the front deployment (only the head has ``FRONT_RESOURCE``);
each worker node advertises ``REPLICA_RESOURCE`` units -- every replica takes one
(``replica_resource``) -- and exactly the CPUs of its replicas, so nothing else lands there.
Node failure is detected in about a second and a half on an idle machine (health checks every
0.5 s, three misses; ``fast_node_failure``) instead of Ray's default tens of seconds.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from stretch import stretched

REPO = Path(__file__).resolve().parents[1]
REPLICA_RESOURCE = "ray_attn_replica"
FRONT_RESOURCE = "ray_attn_front"  # the head's only: the front deployment stays there
HEAD_CPUS = 3
def fast_node_failure() -> dict:
    """Ray's node health checks for these clusters: every 0.5 s, three misses make a node dead
    (about a second and a half on an idle machine, instead of Ray's default tens of seconds).
    Each check's timeout grows with the machine's load (``stretched``, the tests' time scale),
    as the tests' other waits do: on a busy box a raylet slow to answer is not a dead one."""
    return {"health_check_period_ms": 500, "health_check_failure_threshold": 3,
            "health_check_timeout_ms": int(stretched(1.0) * 1000)}


@dataclass
class SimCluster:
    cluster: object
    replica_cpus: float
    replicas_per_node: int = 1
    workers: list = field(default_factory=list)
    front_cpus: float = 0.0  # each worker's room for a front replica besides its replicas

    def add_replica_node(self):
        node = self.cluster.add_node(num_cpus=self.replica_cpus * self.replicas_per_node + self.front_cpus,
                                     resources={REPLICA_RESOURCE: self.replicas_per_node})
        self.workers.append(node)
        self.cluster.wait_for_nodes()
        return node

    def remove(self, node) -> list[int]:
        """Kill the node's raylet and every process on it, as a crashed machine would go.
        ``remove_node`` kills the node's own daemons; the workers under its raylet (replicas,
        ranks) would only exit once they notice, seconds later, and a replica could meanwhile
        finish the very work whose loss a test means to cause -- so they are killed too."""
        # (not also the GCS's actor table: reading it here delays the kill by a GCS round trip,
        # and a test that kills a node holding a stream in prefill then finds it past prefill)
        under = {pid for _, proc in node.live_processes() for pid in descendants(proc.pid)}
        self.cluster.remove_node(node, allow_graceful=False)
        kill_pids(under)
        self.workers.remove(node)
        return sorted(under)

    def node_of(self, node_id: str):
        for n in self.workers:
            if n.node_id == node_id:
                return n
        raise KeyError(f"node {node_id} is not one of the worker nodes")


def descendants(pid: int) -> list[int]:
    """Every live process under ``pid``, read from /proc (the raylet's workers, which Ray starts
    each in a process group of its own, so a group signal misses them).  Read before a kill:
    once the raylet is dead its workers belong to init."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                # the field after the ")" that ends the command name: state, then the parent pid
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone since the listing
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def kill_pids(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start_cluster(num_replica_nodes: int, replica_cpus: float, replicas_per_node: int = 1,
                  front_cpus: float = 0.0, gcs_storage_path: str | None = None) -> SimCluster:
    """``gcs_storage_path``: the GCS keeps its tables in RocksDB there (Ray's
    ``RAY_gcs_storage=rocksdb``), so a GCS that dies and is started again finds the cluster as it
    was -- the role an external Redis plays in Ray's GCS fault tolerance.  Default: in memory."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():  # an earlier test package's session in this process
        ray.shutdown()
    # Serve names a replica no node can hold after this long (30 s by default): tests wait less.
    os.environ.setdefault("RAY_SERVE_SLOW_STARTUP_WARNING_S", "2")
    # Raylets started from here pass this on to their workers: replicas import this checkout.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": HEAD_CPUS, "resources": {FRONT_RESOURCE: 1}, "include_dashboard": False,
        "_system_config": dict(fast_node_failure(), **(
            {"gcs_storage": "rocksdb", "gcs_storage_path": gcs_storage_path} if gcs_storage_path else {}))})
    sim = SimCluster(cluster, replica_cpus, replicas_per_node, front_cpus=front_cpus)
    try:
        for _ in range(num_replica_nodes):
            sim.add_replica_node()
        ray.init(address=cluster.address, log_to_driver=False)
    except BaseException:
        cluster.shutdown()
        raise
    return sim


def stop_cluster(sim: SimCluster) -> None:
    """Every process of every node killed, Serve's with them: ``serve.shutdown()`` first would
    wait for each replica to stop gracefully (seconds, for a cluster about to go).  Serve drops
    its handle to this cluster's controller by itself when a later session starts."""
    import ray

    try:
        ray.shutdown()
    finally:
        sim.cluster.shutdown()


def replica_nodes(app: str, deployment: str = "LLMServer") -> dict[str, str]:
    """Each alive replica of ``app``'s ``deployment``: unique id -> node id (the GCS's actor table)."""
    return {uid: a["Address"]["NodeID"] for uid, a in replica_actors(app, deployment).items()}


def replica_actors(app: str, deployment: str = "LLMServer") -> dict[str, dict]:
    """Each alive replica of ``app``'s ``deployment``: unique id -> its actor table entry (node, pid)."""
    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    return {name[len(prefix):]: a for name, a in alive_named_actors(prefix).items()}


def alive_named_actors(prefix: str) -> dict[str, dict]:
    """Each alive actor whose name starts with ``prefix``: its name -> its entry in the GCS's
    actor table (node, pid)."""
    import ray

    return {a["Name"]: a for a in ray._private.state.actors().values()
            if a["State"] == "ALIVE" and (a.get("Name") or "").startswith(prefix)}


def wait_replicas(app: str, n: int, timeout: float = 120.0) -> dict[str, str]:
    """Wait until ``app`` runs exactly ``n`` healthy replicas; their nodes."""
    from ray import serve

    deadline = time.monotonic() + stretched(timeout)
    last = None
    while time.monotonic() < deadline:
        last = serve.status().applications.get(app)
        if last is not None and last.status == "RUNNING":
            states = last.deployments["LLMServer"].replica_states
            fronts = last.deployments.get("PrefixRoutingIngress")
            fronts_up = fronts is None or set(fronts.replica_states) <= {"RUNNING"}
            if states.get("RUNNING", 0) == n and sum(states.values()) == n and fronts_up:
                nodes = replica_nodes(app)
                if len(nodes) == n:
                    return nodes
        time.sleep(0.2)
    raise TimeoutError(f"{app}: {n} running replicas not reached within {stretched(timeout):.0f}s: {last}")


