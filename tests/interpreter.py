"""Running a test module's Triton kernels on CPU: the module again, in a subprocess with
TRITON_INTERPRET=1 (read when a kernel is defined, so not in this process, where other tests'
kernels must stay compiled ones).  The kernel modules a run collects share one such subprocess
(~13 s less than one each), and each module's interpreter test checks its own results in it."""

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


def _run_interpreted(files: list[str]) -> None:
    global _OUTPUT
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *files,
                          "-k", "not under_the_interpreter"], cwd=root, capture_output=True, text=True,
                         env=dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore"), timeout=900)
    _OUTPUT = out.stdout[-3000:] + out.stderr[-2000:]
    for f in files:
        rel = os.path.relpath(f, root)
        passed = re.findall(rf"^PASSED ({re.escape(rel)}::\S+)", out.stdout, re.M)
        failed = re.findall(rf"^(?:FAILED|ERROR) ({re.escape(rel)}(?:::\S+)?)", out.stdout, re.M)
        if out.returncode not in (0, 1) and not failed:  # no report at all: the run itself failed
            failed = [f"{rel} (pytest exited {out.returncode})"]
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
