import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import pytest
import torch

from tests.interpreter import SHARD_ENV
from tests.timescale import TIME_SCALE, busy_cpus, scaled

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# GGUF tokenizers are converted once per run and read back after (ray_attn/gguf_file.py): a cache
# of this run's own, shared by its subprocesses and Ray workers, and gone with it -- a run neither
# reads nor fills the user's ~/.cache.
if "RAY_ATTN_CACHE_DIR" not in os.environ:
    os.environ["RAY_ATTN_CACHE_DIR"] = tempfile.mkdtemp(prefix="ray_attn_test_cache_")
    atexit.register(shutil.rmtree, os.environ["RAY_ATTN_CACHE_DIR"], True)
# Serve's controller kills an HTTP proxy that is not ready within 5 s, or whose health check takes
# 10 s (RAY_SERVE_PROXY_*): on a loaded machine a proxy takes longer just to start, and
# serve.start() then dies with "ProxyActor ... killed by ray.kill ... never ran".  Ray actors
# inherit these from the process that starts the cluster, and scripts under test from us.
os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", str(round(scaled(30))))
os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", str(round(scaled(30))))
# and checks a proxy every 10 s: a test that kills one (tests/cluster) waited that long for its
# replacement.  Every 2 s costs a cheap actor call each time.
os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_PERIOD_S", "2")

# Serve's proxies refuse unkeyed requests to keyed apps themselves, as under `ray-attn serve`
# (ray_attn/serve/proxy_auth.py); the tests' clusters inherit this from us.
os.environ.setdefault("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", "ray_attn.serve.proxy_auth:proxy_middlewares")

# Ray starts its workers at niceness 15; beside a CPU hog at 0 each gets a few percent of a core,
# and a test's actors (Serve replicas, stores, ranks before they renice: runtime/worker.py
# ``unnice``) crawl.  The tests' own clusters inherit this from us.
os.environ.setdefault("RAY_worker_niceness", "0")

# Torch's OpenMP threads spin-wait on each other, and beside a CPU hog one descheduled thread
# stalls the rest: a 256-token prefill took 1.0 s with 2 threads against 0.05 s with 1 on a loaded
# 2-core box (scripts/bench_kv_tiers.py).  On a busy machine every rank -- in this process or an
# actor, which inherits the variable -- and this process compute on one thread.  Busy: slow (the
# time scale), or half a core or more taken by others when the run starts -- a hog started with
# the run leaves the scale at 1 (its one core free) yet made the gate's in-process rows 10x
# slower on two threads.  Set once, before any test has run torch, and kept for the run.
if "RAY_ATTN_CPU_THREADS" not in os.environ and (TIME_SCALE > 1.5 or busy_cpus() >= 0.5):
    os.environ.setdefault("RAY_ATTN_CPU_THREADS", "1")
    torch.set_num_threads(1)


def pytest_report_header(config):
    threads = os.environ.get("RAY_ATTN_CPU_THREADS", "the ranks' share of the cores")
    return (f"test time scale: {TIME_SCALE:.2f} (RAY_ATTN_TEST_TIME_SCALE; waits are stretched by it); "
            f"CPU threads per rank: {threads}")


def pytest_collection_modifyitems(config, items):
    from tests.interpreter import note_collected

    note_collected(items)  # the kernel modules whose interpreted runs share one subprocess
    shard = os.environ.get(SHARD_ENV)
    if shard:  # one of tests/interpreter.py's concurrent runs: every n-th test, from the i-th
        i, n = (int(x) for x in shard.split("/"))
        keep = [item for j, item in enumerate(items) if j % n == i]
        config.hook.pytest_deselected(items=[item for j, item in enumerate(items) if j % n != i])
        items[:] = keep
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Folders whose engines may take an earlier engine's rank actors (ray_attn/runtime/rank_pool.py):
# a rank's process start (torch imported again) was the run's largest wait.  A parked group holds
# its bundles' CPUs, which Serve apps, clusters and scripts elsewhere need, so the pool is drained
# as soon as a test of another folder starts.
WARM_RANK_FOLDERS = {"runtime", "spec", "model", "planner", "backend", "lora"}


def pytest_runtest_setup(item):
    from ray_attn.runtime import rank_pool

    warm = item.path.parent.name in WARM_RANK_FOLDERS and item.path.parent.parent.name == "tests"
    if not warm:
        rank_pool.drain()
    rank_pool.enabled = warm


@pytest.fixture(scope="session")
def shared_ray():
    """The one local Ray cluster of the run (tests/shared_ray.py), started on first use."""
    from tests import shared_ray as cluster

    cluster.ensure()
    yield
    cluster.shutdown()


@pytest.fixture
def rng(request):
    # Random inputs that differ per test case yet reproduce exactly on a rerun of that case.
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


# ------------------------------------------------------------------ a summary, whatever happens
# Two ways a run with Ray in it used to end with no summary:
# - ray.init installs a SIGTERM handler in the driver that raises SystemExit.  Inside a test that
#   is only a failed test, so pytest went on to the next one (and the next hang) until something
#   sent SIGKILL.  Here SIGTERM ends the session instead, with its summary.
# - a Ray driver whose GCS is gone exits the process from C++ after 60 s (see summary_guard.py):
#   nothing in this process can print after that, so a child process does, from the events fed
#   to it by _SummaryGuard.
def _sigterm(signum, frame):
    pytest.exit(f"SIGTERM: the run was stopped from outside (signal {signum})", returncode=143)


class _SummaryGuard:
    """Feeds tests/summary_guard.py one line per test event; tells it when pytest ended cleanly."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    def send(self, *fields: str) -> None:
        if self.proc.stdin is None or self.proc.stdin.closed:
            return
        try:
            self.proc.stdin.write("\t".join(f.replace("\t", " ").replace("\n", " ") for f in fields) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            pass  # the guard is gone: the run goes on without it

    def pytest_runtest_logstart(self, nodeid):
        self.send("start", nodeid)

    def pytest_runtest_logreport(self, report):
        self.send("report", report.nodeid, report.when, report.outcome)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_call(self, item):
        # The test's fixtures have run: a ray.init among them put Ray's handler back.
        if signal.getsignal(signal.SIGTERM) is not _sigterm:
            signal.signal(signal.SIGTERM, _sigterm)

    def pytest_unconfigure(self, config):
        self.send("end")
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=scaled(10))
        except (OSError, subprocess.TimeoutExpired):
            pass


def pytest_configure(config):
    if hasattr(config, "workerinput") or config.option.collectonly:
        return  # an xdist worker reports to its controller, which has its own guard
    signal.signal(signal.SIGTERM, _sigterm)
    # Output capture is suspended while plugins configure: the guard inherits the real stdout.
    # Its own session: a Ctrl-C or a group kill meant for pytest leaves it there to report.
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("summary_guard.py"))],
                            stdin=subprocess.PIPE, text=True, start_new_session=True)
    config.pluginmanager.register(_SummaryGuard(proc), "ray_attn_summary_guard")


# -- exit ---------------------------------------------------------------------------------------
# Two full runs (of ~30) ended with every test passed and then "Segmentation fault" while the
# interpreter tore down what the run left in it (torch's thread pools, gloo process groups of
# in-process TP tests, Ray's client threads); the exit status 139 then failed `make test`.  The
# command-line run ends here instead, once every plugin has reported: Ray shut down and the
# run's cache removed as the atexit handlers would, then the process leaves with pytest's status.
def _main_is_pytest() -> bool:
    main = sys.argv[0] if sys.argv else ""
    return os.path.basename(main) in ("pytest", "py.test") or main.endswith(os.path.join("pytest", "__main__.py"))


def pytest_sessionfinish(session, exitstatus):
    session.config._ray_attn_exitstatus = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    status = getattr(config, "_ray_attn_exitstatus", None)
    if status is None or hasattr(config, "workerinput") or not _main_is_pytest():
        return
    try:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    except Exception:  # noqa: BLE001 -- the run's verdict is already out
        pass
    cache = os.environ.get("RAY_ATTN_CACHE_DIR", "")
    if os.path.basename(cache).startswith("ray_attn_test_cache_"):  # ours, not a user's
        shutil.rmtree(cache, ignore_errors=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
