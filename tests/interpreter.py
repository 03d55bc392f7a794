"""Running a test module's Triton kernels on CPU: the module again, in a subprocess with
TRITON_INTERPRET=1 (read when a kernel is defined, so not in this process, where other tests'
kernels must stay compiled ones).  The kernel modules a run collects share one such subprocess
(~13 s less than one each), and each module's interpreter test checks its own results in it.
That run is split over the cores (``SHARD_ENV``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def kernels_run_here() -> bool:
    """A GPU, or this process is the interpreter's: the kernels' own tests run here."""
    return torch.cuda.is_available() or INTERPRETED


# The modules whose kernel tests this run collected (set by tests/conftest.py at collection): the
# first of them to ask runs them all in one interpreted subprocess (one interpreter start, torch
# import and collection instead of one per module), and each reads its own results.
COLLECTED: set[str] = set()
_RESULTS: dict[str, tuple[list[str], list[str]]] = {}  # file -> (passed node ids, failed ones)
_OUTPUT = ""


def note_collected(items) -> None:
    """Remember the collected modules whose interpreter test (``*_under_the_interpreter``) runs
    through this module's ``run_module_interpreted``."""
    for item in items:
        module = getattr(item, "module", None)
        if item.name.endswith("under_the_interpreter") and (
                getattr(module, "run_module_interpreted", None) is run_module_interpreted
                or getattr(module, "interpreter_test", None) is interpreter_test):
            COLLECTED.add(str(Path(str(item.path)).resolve()))


# Set in each interpreted run to "i/n": tests/conftest.py keeps every n-th collected test from the
# i-th.  The interpreter computes on one core, and the run waits for it with the others idle: two
# runs side by side took 32 s where one took 51 (nine modules, 2 cores; each run still pays its own
# ~8 s start).  Interleaved tests, not whole modules: one module (fp8 weights) is 40% of the time.
SHARD_ENV = "RAY_ATTN_TEST_SHARD"


def _shards() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def _run_interpreted(files: list[str]) -> None:
    global _OUTPUT
    root = Path(__file__).resolve().parents[1]
    n = _shards()
    # one torch thread each: n runs on n cores, not n runs of two spin-waiting threads on them
    runs = [subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *files,
                              "-k", "not under_the_interpreter"], cwd=root, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore",
                                      OMP_NUM_THREADS="1", **{SHARD_ENV: f"{i}/{n}"}))
            for i in range(n)]
    outs = []
    for run in runs:
        try:
            stdout, stderr = run.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            for r in runs:
                r.kill()
            raise
        outs.append((run.returncode, stdout, stderr))
    _OUTPUT = "".join(f"--- shard {i}/{n} (exit {rc})\n{o[-3000:]}{e[-2000:]}" for i, (rc, o, e) in enumerate(outs))
    for f in files:
        rel = os.path.relpath(f, root)
        passed, failed = [], []
        for rc, stdout, _ in outs:
            passed += re.findall(rf"^PASSED ({re.escape(rel)}::\S+)", stdout, re.M)
            failed += re.findall(rf"^(?:FAILED|ERROR) ({re.escape(rel)}(?:::\S+)?)", stdout, re.M)
            # no report at all (exit 5, nothing collected, is a shard with none of its tests): the run failed
            if rc not in (0, 1, 5) and not re.search(r"^(?:FAILED|ERROR) ", stdout, re.M):
                failed.append(f"{rel} (pytest exited {rc})")
        twice = sorted({t for t in passed if passed.count(t) > 1})
        if twice:  # the shards must split the tests, not repeat them
            failed.append(f"{rel}: {len(twice)} tests ran in more than one shard, e.g. {twice[0]}")
        _RESULTS[f] = (passed, failed)


def run_module_interpreted(test_file: str, min_passed: int) -> None:
    """Run ``test_file``'s tests but the one calling this under the interpreter; at least
    ``min_passed`` must pass (a module that skipped them all would otherwise look green)."""
    f = str(Path(test_file).resolve())
    if f not in _RESULTS:
        _run_interpreted(sorted(COLLECTED | {f}) if f in COLLECTED else [f])
    passed, failed = _RESULTS[f]
    assert not failed, (failed, _OUTPUT)
    assert len(passed) >= min_passed, (len(passed), min_passed, _OUTPUT)


def kernels_mark(triton_module):
    """Skip a kernel test in a CPU process that is not the interpreter's (or without Triton)."""
    import pytest

    return pytest.mark.skipif(triton_module is None or not kernels_run_here(),
                              reason="CPU: run by the module's interpreter test in a subprocess")


def interpreter_test(test_file: str, min_passed: int) -> None:
    """The body of a module's ``test_..._under_the_interpreter``: on CPU, its kernel tests again
    under TRITON_INTERPRET=1; where the kernels run in-process, a skip."""
    import pytest

    pytest.importorskip("triton")
    if kernels_run_here():
        pytest.skip("the kernels' tests run in this process")
    run_module_interpreted(test_file, min_passed=min_passed)
