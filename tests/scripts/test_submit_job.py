"""A real head node on loopback (dashboard on, token auth on), ``ray job submit`` through
scripts/submit_job.py, the batch job's output file checked against the engine's generate."""

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
from pathlib import Path

import httpx
import pytest

from tests.scripts.test_batch_generate import reference, write_prompts
from tests.timescale import scaled
from ray_attn.ports import loopback_ports

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def token_env(tmp: Path) -> dict:
    """This process's environment without Ray's settings, with a fresh auth token in ``tmp``."""
    token = tmp / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != "PYTHONPATH"}
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token),
               PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    return env


def start_group(cmd: list[str], env: dict, log_path: Path) -> subprocess.Popen:
    """``cmd`` in a process group of its own, its output to ``log_path``."""
    return subprocess.Popen(cmd, env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def kill_group(proc: subprocess.Popen, grace: float = 3.0) -> None:
    """Stop the group ``proc`` leads: SIGTERM, then SIGKILL for whatever is left.  A node's
    daemons (gcs_server, raylet, dashboard) share the group and may outlive ``ray start`` on
    SIGTERM; the SIGKILL round ends them."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass


def start_head(tmp: Path, env: dict, num_cpus: int, *extra: str) -> tuple[subprocess.Popen, str, int]:
    """``ray start --head --block`` (dashboard on) in its own process group, once its dashboard
    answers: (process, dashboard address, GCS port).  A head that does not come up is stopped."""
    gcs, dash, client, agent = loopback_ports(4)  # four at once: one at a time may repeat a port
    proc = start_group([str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
                        f"--port={gcs}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                        f"--dashboard-port={dash}", f"--ray-client-server-port={client}",
                        f"--dashboard-agent-listen-port={agent}", f"--num-cpus={num_cpus}",
                        f"--temp-dir={tmp / 'ray'}", "--disable-usage-stats", *extra], env, tmp / "head.log")
    address = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.monotonic() + scaled(90)
        while True:
            assert proc.poll() is None, (tmp / "head.log").read_text()[-3000:]
            try:
                if httpx.get(f"{address}/api/version", timeout=scaled(2)).status_code in (200, 401, 403):
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "dashboard did not come up"
            time.sleep(0.5)
    except BaseException:
        kill_group(proc)
        raise
    return proc, address, gcs


@pytest.fixture(scope="module")
def head_node():
    """A head node in its own process group; stopped by signalling that group (only the
    processes this test started -- not ``ray stop``, which stops every Ray on the host)."""
    tmp = Path(tempfile.mkdtemp(prefix="rj", dir="/tmp"))  # short: Ray's socket paths are limited
    env = token_env(tmp)
    t0 = time.perf_counter()
    try:
        proc, address, _ = start_head(tmp, env, num_cpus=4)
        print(f"\nhead node up in {time.perf_counter() - t0:.1f}s at {address}")
        try:
            yield address, env
        finally:
            t0 = time.perf_counter()
            kill_group(proc)
            print(f"head node stopped in {time.perf_counter() - t0:.1f}s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def submit(address: str, env: dict, batch_args: list, *extra: str, timeout: float = 240):
    cmd = [sys.executable, str(REPO / "scripts" / "submit_job.py"), "--address", address,
           "--working-dir", str(REPO), "--python", str(BIN / "python"), "--timeout", "180",
           "--poll", "0.5", *extra, "--", *map(str, batch_args)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_submitted_batch_job_writes_the_expected_output(head_node, tmp_path):
    address, env = head_node
    inp, out = tmp_path / "prompts.jsonl", tmp_path / "results.jsonl"
    bodies = write_prompts(inp, n=8, seed=31)
    t0 = time.perf_counter()
    proc = submit(address, env, ["--input", inp, "--output", out, "--tp", 2, "--max-in-flight", 4])
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "SUCCEEDED" in proc.stdout
    assert "submitted job ray_attn_batch_" in proc.stdout
    assert "generate" in proc.stdout  # the job's logs, fetched, include its progress bar
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"r{i}" for i in range(len(bodies))]
    assert [r["token_ids"] for r in rows] == reference(bodies)
    print(f"job submitted, run and checked in {wall:.1f}s")


def test_submitted_job_on_two_engine_replicas_resumes_a_partial_output(head_node, tmp_path):
    """The job's replica actors run under the job's runtime env (the uploaded working dir), on
    the cluster's CPUs; an output with 3 finished lines is resumed, not redone."""
    address, env = head_node
    inp, out = tmp_path / "prompts.jsonl", tmp_path / "results.jsonl"
    bodies = write_prompts(inp, n=8, seed=32)
    want = reference(bodies)
    head = "".join(json.dumps({"index": i, "id": f"r{i}", "token_ids": want[i], "text": None,
                               "finish_reason": "length", "error": None, "usage": {}}) + "\n"
                   for i in (0, 3, 6))
    out.write_text(head)
    proc = submit(address, env, ["--input", inp, "--output", out, "--replicas", 2, "--executor",
                                 "in_process", "--resume", "--max-in-flight", 2])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert '"skipped": 3' in proc.stdout and '"replicas": 2' in proc.stdout
    assert out.read_text().startswith(head)
    rows = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["index"])
    assert [r["index"] for r in rows] == list(range(len(bodies)))
    assert [r["token_ids"] for r in rows] == want


def test_submission_without_the_token_is_refused(head_node, tmp_path):
    address, env = head_node
    env = {k: v for k, v in env.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")}
    env["RAY_AUTH_TOKEN_PATH"] = str(tmp_path / "missing_token")
    proc = submit(address, env, ["--input", "x.jsonl", "--output", "y.jsonl"], "--auth", "env",
                  timeout=scaled(60))
    assert proc.returncode != 0
    assert "uthentication" in proc.stdout + proc.stderr
