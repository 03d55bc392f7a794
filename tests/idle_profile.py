"""Where the suite leaves the machine's cores idle: a pytest plugin, off unless asked for.

    HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q -p no:cacheprovider -p tests.idle_profile

The suite's time on a 2-core box is mostly CPU (Ray workers starting, torch imported again, the
interpreter), so a test that holds the run while the cores sit idle -- a timeout waited out, one
process computing on one core -- is time that a shorter wait or a second process would take back.
For each setup, call and teardown phase this reads ``/proc/stat`` before and after, and at the end
prints the phases with the most idle core-seconds (wall time times the share of all cores' ticks
that were idle), and writes every phase to ``RAY_ATTN_IDLE_PROFILE`` when that names a file.
The clock is ``perf_counter``: some tests patch ``time.monotonic``.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from tests.timescale import cpu_ticks

_rows: list[tuple[str, str, float, float]] = []  # node id, phase, wall s, idle share of the ticks
_CPUS = os.cpu_count() or 1


def _ticks() -> tuple[int, int]:
    """``timescale.cpu_ticks()``; (0, 0) without ``/proc/stat``."""
    try:
        return cpu_ticks()
    except (OSError, ValueError, IndexError):
        return 0, 0


def _timed(item, phase):
    t0, (all0, idle0) = time.perf_counter(), _ticks()
    yield
    t1, (all1, idle1) = time.perf_counter(), _ticks()
    share = (idle1 - idle0) / (all1 - all0) if all1 > all0 else 0.0
    _rows.append((item.nodeid, phase, t1 - t0, min(1.0, max(0.0, share))))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _timed(item, "setup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _timed(item, "call")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield from _timed(item, "teardown")


def idle_core_s(row) -> float:
    """Core-seconds a phase left idle: its wall time times the idle share, times the cores."""
    return row[2] * row[3] * _CPUS


def pytest_terminal_summary(terminalreporter):
    if not _rows:
        return
    wall = sum(r[2] for r in _rows)
    idle = sum(idle_core_s(r) for r in _rows)
    tr = terminalreporter
    tr.write_sep("=", f"idle cores: {idle:.0f} core-s of {wall * _CPUS:.0f} over {wall:.0f} s of tests "
                      f"({idle / max(wall * _CPUS, 1e-9):.0%}) on {_CPUS} cores")
    for row in sorted(_rows, key=idle_core_s, reverse=True)[:25]:
        tr.write_line(f"{idle_core_s(row):7.1f} idle core-s of {row[2]:6.1f} s  {row[1]:8s} {row[0]}")
    out = os.environ.get("RAY_ATTN_IDLE_PROFILE")
    if out:
        with open(out, "w") as f:
            json.dump({"cpus": _CPUS, "phases": _rows}, f)
