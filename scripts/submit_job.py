#!/usr/bin/env python
"""Submit ``scripts/batch_generate.py`` to a Ray cluster as a job, wait for it, print its logs.

Wraps::

    ray job submit --address ADDRESS --working-dir . --submission-id ID --no-wait \\
        -- python scripts/batch_generate.py ARGS...

then polls the job until it ends (or ``--timeout`` passes: the job is then stopped), prints its
logs and exits 0 only if the job SUCCEEDED.  Everything after ``--`` goes to batch_generate.py::

    python scripts/submit_job.py --address http://127.0.0.1:8265 -- \\
        --input data/prompts.jsonl --output /shared/results.jsonl --tp 2

Paths in the batch arguments are resolved on the cluster: relative ones inside the uploaded working
directory (inputs that ship with it), so write the output to storage that every node and you can
reach, or to an absolute path on a single-node cluster.

Authentication: Ray's token authentication stays as the cluster has it.  With ``--auth auto``
(default) the client sends the token when one is available locally (``RAY_AUTH_TOKEN``,
``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``), as ``RAY_AUTH_MODE=token`` would.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
EXCLUDES = [".git", ".venv", ".hypothesis", ".pytest_cache", "benchmarks/results", "**/__pycache__"]


def default_address() -> str:
    return (os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_DASHBOARD_ADDRESS")
            or "http://127.0.0.1:8265")


def ray_cli() -> list[str]:
    """The ``ray`` next to this interpreter, else the one on PATH."""
    here = Path(sys.executable).parent / "ray"
    if here.exists():
        return [str(here)]
    found = shutil.which("ray")
    if found:
        return [found]
    return [sys.executable, "-m", "ray.scripts.scripts"]


def token_available() -> bool:
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token")
    return Path(path).is_file()


def auth_env(mode: str) -> dict[str, str]:
    """The environment for the Ray client calls.  Never turns authentication off."""
    env = dict(os.environ)
    if mode == "token" or (mode == "auto" and "RAY_AUTH_MODE" not in env and token_available()):
        env["RAY_AUTH_MODE"] = "token"
    return env


def submit(args, batch_args: list[str], env: dict) -> str:
    sid = args.submission_id or f"ray_attn_batch_{uuid.uuid4().hex[:12]}"
    cmd = [*ray_cli(), "job", "submit", "--address", args.address, "--working-dir", args.working_dir,
           "--runtime-env-json", json.dumps({"excludes": EXCLUDES}),
           "--submission-id", sid, "--no-wait", "--",
           args.python, "scripts/batch_generate.py", *batch_args]
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=args.submit_timeout)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"ray job submit failed (exit {proc.returncode})")
    print(f"submitted job {sid}", flush=True)
    return sid


def wait(client, sid: str, timeout: float, poll_s: float) -> str:
    deadline = time.monotonic() + timeout
    last = None
    while True:
        status = str(client.get_job_status(sid)).split(".")[-1]
        if status != last:
            print(f"job {sid}: {status}", flush=True)
            last = status
        if status in TERMINAL:
            return status
        if time.monotonic() > deadline:
            print(f"job {sid}: still {status} after {timeout:.0f}s; stopping it", flush=True)
            client.stop_job(sid)
            return "TIMEOUT"
        time.sleep(poll_s)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    batch_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, batch_args = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="%(prog)s [options] -- BATCH_GENERATE_ARGS...")
    p.add_argument("--address", default=default_address(),
                   help="the cluster's job API (dashboard) address, e.g. http://HEAD:8265 "
                        "(default: $RAY_API_SERVER_ADDRESS or http://127.0.0.1:8265)")
    p.add_argument("--working-dir", default=str(REPO), help="directory uploaded with the job (default: repo root)")
    p.add_argument("--submission-id", default=None, help="job id to use (default: generated)")
    p.add_argument("--python", default="python", help="interpreter on the cluster (default: python)")
    p.add_argument("--no-wait", action="store_true", help="print the job id and return")
    p.add_argument("--timeout", type=float, default=3600, help="seconds to wait before stopping the job")
    p.add_argument("--poll", type=float, default=1.0, help="seconds between status checks")
    p.add_argument("--submit-timeout", type=float, default=300, help="seconds for the submit call itself")
    p.add_argument("--auth", choices=["auto", "token", "env"], default="auto",
                   help="'auto': send the local Ray token when there is one; 'token': always "
                        "(RAY_AUTH_MODE=token); 'env': use the environment as it is")
    args = p.parse_args(argv)
    if not batch_args:
        p.error("give the batch_generate.py arguments after --, e.g. -- --input in.jsonl --output out.jsonl")

    env = auth_env(args.auth)
    sid = submit(args, batch_args, env)
    if args.no_wait:
        return 0
    os.environ.update({k: v for k, v in env.items() if k == "RAY_AUTH_MODE"})
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(args.address)
    status = wait(client, sid, args.timeout, args.poll)
    print(f"----- logs of job {sid} -----", flush=True)
    print(client.get_job_logs(sid), flush=True)
    print(f"----- job {sid}: {status} -----", flush=True)
    return 0 if status == "SUCCEEDED" else 1


if __name__ == "__main__":
    sys.exit(main())
