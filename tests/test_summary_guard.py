"""A pytest run prints a summary however it ends: stopped by SIGTERM after a ``ray.init`` put
Ray's own handler in, or ended from C (a Ray driver whose GCS died calls ``_exit``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.summary_guard import summarize
from tests.timescale import scaled

REPO = Path(__file__).resolve().parents[1]


def run_pytest(tmp_path: Path, body: str) -> str:
    (tmp_path / "test_victim.py").write_text(textwrap.dedent(body))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                           "test_victim.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=scaled(120))
    return proc.stdout + proc.stderr


def test_a_process_that_exits_from_c_still_gets_a_summary(tmp_path):
    out = run_pytest(tmp_path, """
        import os

        def test_0_fails():
            assert False

        def test_1_passes():
            pass

        def test_2_dies():
            os._exit(3)  # what the core worker does when the GCS is gone

        def test_3_never_runs():
            pass
    """)
    assert "pytest ended without its own summary" in out, out
    assert "Running at the end: test_victim.py::test_2_dies (call)" in out
    assert "FAILED test_victim.py::test_0_fails" in out and "1 failed, 1 passed" in out


def test_sigterm_after_ray_init_ends_the_session_with_its_summary(tmp_path):
    out = run_pytest(tmp_path, """
        import os
        import signal
        import sys
        import time

        import pytest

        @pytest.fixture
        def ray_like():
            signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))  # as ray.init does

        def test_0_passes():
            pass

        def test_1_stopped(ray_like):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)

        def test_2_must_not_run():
            pass
    """)
    assert "Exit: SIGTERM" in out and "1 passed" in out, out
    assert "2 passed" not in out and "pytest ended without its own summary" not in out


@pytest.mark.parametrize("lines,want", [
    (["start\ta", "report\ta\tsetup\tpassed", "report\ta\tcall\tpassed", "report\ta\tteardown\tpassed",
      "end"], None),
    (["start\ta", "report\ta\tsetup\tpassed", "report\ta\tcall\tfailed", "report\ta\tteardown\tpassed",
      "start\tb", "report\tb\tsetup\tpassed"], ["FAILED a", "Running at the end: b (call)", "1 failed;"]),
    (["start\ta", "report\ta\tsetup\tfailed", "report\ta\tteardown\tpassed",
      "start\tb", "report\tb\tsetup\tskipped", "report\tb\tteardown\tpassed"],
     ["ERROR a", "1 error, 1 skipped; no test unfinished"]),
    (["start\ta", "report\ta\tsetup\tpassed", "report\ta\tcall\tpassed", "report\ta\tteardown\tfailed"],
     ["ERROR a", "1 error; no test unfinished"]),
])
def test_summarize(lines, want):
    text = summarize([line + "\n" for line in lines])
    if want is None:
        assert text is None
    else:
        for piece in want:
            assert piece in text, text
