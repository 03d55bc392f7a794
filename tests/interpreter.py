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
