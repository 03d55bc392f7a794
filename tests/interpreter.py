"""Running a test module's Triton kernels on CPU: the module again, in a subprocess with
TRITON_INTERPRET=1 (read when a kernel is defined, so not in this process, where other tests'
kernels must stay compiled ones)."""

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


def run_module_interpreted(test_file: str, min_passed: int) -> None:
    """Run ``test_file``'s tests but the one calling this under the interpreter; at least
    ``min_passed`` must pass (a module that skipped them all would otherwise look green)."""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file),
                          "-k", "not under_the_interpreter"], cwd=root, capture_output=True, text=True,
                         env=dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore"), timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    passed = re.search(r"(\d+) passed", out.stdout)
    assert passed and int(passed.group(1)) >= min_passed, out.stdout[-2000:]


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
