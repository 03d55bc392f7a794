"""A cluster of ``ray start`` nodes on one machine whose head can be lost and started again, for
``scripts/bench_node_loss.py --losses head-node``.

``simcluster.py``'s cluster cannot lose its head: ``ray.cluster_utils.Cluster`` runs the head's
daemons under the driver, and a driver whose raylet dies exits.  Here every node is a ``ray
start --block`` in a process group of its own, the driver that deploys Serve is a short-lived
subprocess, and the caller talks to the cluster over HTTP only.  The GCS keeps its tables in
RocksDB (Ray's ``gcs_storage``; an external Redis plays this part on a real cluster), so a head
started again at the same address finds the cluster as it was: the worker nodes' raylets
reconnect to it (within ``gcs_rpc_server_reconnect_timeout_s``, 60 s), and Serve's controller
is restarted there from its checkpoint.  Token authentication is on (Ray's ``RAY_AUTH_MODE``).
Started and stopped by its user -- never ``ray stop``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from simcluster import REPO, descendants, fast_node_failure, kill_pids
from ray_attn.ports import loopback_port as free_port
from ray_attn.ports import loopback_ports

BIN = Path(sys.executable).parent


@dataclass
class RayStartCluster:
    tmp: Path
    env: dict
    gcs_port: int
    head_cpus: float
    head_resources: dict
    head: subprocess.Popen | None = None
    workers: list = field(default_factory=list)
    heads_started: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    def _start(self, args: list[str], log: str) -> subprocess.Popen:
        return subprocess.Popen([str(BIN / "ray"), "start", "--block", "--node-ip-address=127.0.0.1",
                                 "--disable-usage-stats", *args], env=self.env, start_new_session=True,
                                stdout=open(self.tmp / log, "w"), stderr=subprocess.STDOUT)

    def start_head(self) -> None:
        """A head at the cluster's GCS address over the same RocksDB tables.  Each start has a
        temp dir of its own: ``ray start --head`` refuses an address that a live raylet of its
        temp dir's cluster names (the worker nodes' raylets do, while they wait for the GCS)."""
        n = self.heads_started
        self.heads_started += 1
        system = dict(fast_node_failure(), gcs_storage="rocksdb", gcs_storage_path=str(self.tmp / "gcs"))
        self.head = self._start(["--head", f"--port={self.gcs_port}", "--include-dashboard=false",
                                 f"--ray-client-server-port={loopback_ports(1, avoid=[self.gcs_port])[0]}",
                                 f"--num-cpus={int(self.head_cpus)}",
                                 f"--resources={json.dumps(self.head_resources)}", f"--temp-dir={self.tmp / f'h{n}'}",
                                 f"--system-config={json.dumps(system)}"], f"head{n}.log")

    def add_worker(self, num_cpus: float, resources: dict) -> None:
        self.workers.append(self._start([f"--address={self.address}", f"--num-cpus={int(num_cpus)}",
                                         f"--resources={json.dumps(resources)}"], f"worker{len(self.workers)}.log"))

    def kill_head(self) -> list[int]:
        """The head's raylet, GCS and every process on it SIGKILLed, as a crashed machine goes."""
        under = set(descendants(self.head.pid))
        try:
            os.killpg(self.head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        kill_pids(under)
        self.head.wait(timeout=30)
        return sorted(under)

    def run_driver(self, code: str, timeout: float) -> str:
        """``code`` in a Python driver connected to the cluster (``ADDRESS`` is defined); its output."""
        r = subprocess.run([sys.executable, "-c", f"ADDRESS = {self.address!r}\n{code}"], env=self.env,
                           capture_output=True, text=True, timeout=timeout, cwd=REPO)
        if r.returncode != 0:
            raise RuntimeError(f"driver failed ({r.returncode}): {r.stdout[-2000:]}{r.stderr[-3000:]}")
        return r.stdout

    def stop(self) -> None:
        for proc in [*self.workers, self.head]:
            if proc is None:
                continue
            under = set(descendants(proc.pid))
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            kill_pids(under)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        shutil.rmtree(self.tmp, ignore_errors=True)  # its logs, sockets and the GCS's tables


def start(num_workers: int, worker_cpus: float, worker_resources: dict, head_cpus: float = 2,
          head_resources: dict | None = None, join_s: float = 4.0) -> RayStartCluster:
    """A head and ``num_workers`` worker nodes, each joined before the next starts (two raylets
    starting at once on one host lost one in a CI run)."""
    tmp = Path(tempfile.mkdtemp(prefix="rs", dir="/tmp"))  # short: Ray's socket paths are limited
    token = tmp / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != "PYTHONPATH"}
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token),
               PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "scripts")]), PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
               RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH="ray_attn.serve.proxy_auth:proxy_middlewares")
    c = RayStartCluster(tmp, env, free_port(), head_cpus, head_resources or {})
    try:
        c.start_head()
        for i in range(num_workers):  # a worker's raylet waits for the GCS to come up
            if i:
                time.sleep(join_s)
            c.add_worker(worker_cpus, worker_resources)
    except BaseException:
        c.stop()
        raise
    return c
