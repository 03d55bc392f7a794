"""``ray job submit`` of the batch job onto a cluster of three ``ray start`` nodes on loopback (a
head with the dashboard and token auth, two workers with one ``ray_attn_replica`` each), one
worker node killed mid-job -- its raylet and every process on it, by signalling the process group
this test started (never ``ray stop``): the job still writes every record exactly once, with the
tokens a single engine gives."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from simcluster import descendants, fast_node_failure, kill_pids  # scripts/, put on sys.path by tests/cluster/conftest.py
from ray_attn.ports import loopback_port as free_port
from tests.scripts.test_batch_generate import reference, write_prompts
from tests.scripts.test_submit_job import BIN, REPO, kill_group, start_group, start_head, token_env
from tests.timescale import scaled

pytestmark = pytest.mark.slow
FAST_FAILURE = json.dumps(fast_node_failure())


@pytest.fixture
def three_nodes():
    tmp = Path(tempfile.mkdtemp(prefix="rn", dir="/tmp"))  # short: Ray's socket paths are limited
    env = token_env(tmp)
    procs, workers = [], []
    try:
        head, address, gcs = start_head(tmp, env, 2, f"--system-config={FAST_FAILURE}")
        procs.append(head)
        # One worker at a time, each joined before the next starts (two raylets starting at once
        # on one host lost one in a CI run), and a worker that does not join is started again once.
        for i in range(2):
            for attempt in range(2):
                w = start_group([str(BIN / "ray"), "start", "--block", f"--address=127.0.0.1:{gcs}",
                                 "--node-ip-address=127.0.0.1", "--num-cpus=1",
                                 '--resources={"ray_attn_replica": 1}',
                                 f"--dashboard-agent-listen-port={free_port()}", "--disable-usage-stats",
                                 # a temp dir of its own: nodes sharing the head's unpack the job's
                                 # working_dir into one folder, and a worker that started while
                                 # another node replaced it failed to start (its raylet waited the
                                 # 60 s registration timeout before retrying)
                                 f"--temp-dir={tmp / f'n{i}'}"],
                                env, tmp / f"worker{i}.{attempt}.log")
                procs.append(w)
                if wait_nodes(gcs, env, i + 2):
                    break
                kill_group(w)
                procs.remove(w)
            else:
                log = (tmp / f"worker{i}.1.log").read_text()[-2000:]
                pytest.skip(f"worker node {i} of a `ray start` cluster on loopback did not join twice: {log}")
            workers.append(w)
        yield address, env, workers
    finally:
        for p in reversed(procs):
            kill_group(p)
        shutil.rmtree(tmp, ignore_errors=True)


def kill_node(pid: int) -> None:
    """SIGKILL a ``ray start`` node as a crashed machine loses it: its process group (raylet and
    daemons) and every process under it.  The group alone is not enough: the raylet starts each
    worker in a process group of its own, so a replica on the node outlived its raylet by seconds and,
    on a fast machine, finished the job's records before it noticed (CI, 2026-12-02).  The tree is
    read before the kill, since the raylet's death hands its workers to init."""
    tree = descendants(pid)
    os.killpg(pid, signal.SIGKILL)
    kill_pids(tree)


def wait_nodes(gcs: int, env: dict, n: int) -> bool:
    """Whether ``n`` nodes are alive within a (scaled) minute."""
    code = (f"import ray, sys, time; ray.init(address='127.0.0.1:{gcs}', log_to_driver=False)\n"
            f"t = time.monotonic()\n"
            f"while sum(x['Alive'] for x in ray.nodes()) < {n}:\n"
            f"    if time.monotonic() - t > {scaled(60)}: sys.exit(3)\n"
            f"    time.sleep(0.5)\n")
    return subprocess.run([sys.executable, "-c", code], env=env, timeout=scaled(120)).returncode == 0


def test_a_node_killed_mid_job_loses_and_repeats_no_record(three_nodes, tmp_path):
    address, env, workers = three_nodes
    inp, out = tmp_path / "prompts.jsonl", tmp_path / "results.jsonl"
    bodies = write_prompts(inp, n=60, seed=41)
    want = reference(bodies)
    job = subprocess.Popen(
        [sys.executable, str(REPO / "scripts" / "submit_job.py"), "--address", address, "--working-dir",
         str(REPO), "--python", str(BIN / "python"), "--timeout", str(int(scaled(300))), "--poll", "0.5",
         "--", "--input", str(inp), "--output", str(out), "--replicas", "2", "--executor", "in_process",
         "--replica-cpus", "1", "--replica-resource", "ray_attn_replica", "--max-in-flight", "1"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    deadline = time.monotonic() + scaled(240)
    while not (out.exists() and len(out.read_text().splitlines()) >= 3):
        assert job.poll() is None, job.stdout.read()[-4000:]
        assert time.monotonic() < deadline, "the job wrote no records"
        time.sleep(0.1)
    kill_node(workers[0].pid)
    stdout, _ = job.communicate(timeout=scaled(400))
    assert job.returncode == 0, stdout[-4000:]
    assert "replicas_lost" in stdout, stdout[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["index"] for r in rows) == list(range(len(bodies))), "a record lost or written twice"
    assert [r["token_ids"] for r in sorted(rows, key=lambda r: r["index"])] == want


def test_node_health_checks_wait_longer_on_a_loaded_machine(monkeypatch):
    """Issue 43: the clusters' node failure detection is scaled like the tests' other waits -- a
    raylet slow to answer on a busy box must not be declared dead."""
    monkeypatch.setenv("RAY_ATTN_TEST_TIME_SCALE", "1")
    assert fast_node_failure() == {"health_check_period_ms": 500, "health_check_failure_threshold": 3,
                                   "health_check_timeout_ms": 1000}
    monkeypatch.setenv("RAY_ATTN_TEST_TIME_SCALE", "3.5")
    assert fast_node_failure()["health_check_timeout_ms"] == 3500
