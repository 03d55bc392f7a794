"""One factor by which the tests' waits and timeouts grow on a slow or busy machine.

A deadline that a Ray cluster meets in 3 s on an idle box is missed on two cores shared with other
jobs: a worker ping times out, Serve marks a healthy replica unhealthy and replaces it, and the
tests after it fail for a reason that is not theirs.  Every wait that would fail a test when
missed is written for an idle machine and stretched by ``scaled``.

The factor is ``RAY_ATTN_TEST_TIME_SCALE`` when set; otherwise it is measured once per process:
the larger of the 1-minute load average per CPU and a fixed pure-Python workload's time against
its time on an idle reference machine, within [1, 10].  It is exported to the environment, so
subprocesses (scripts under test) use the same factor.  Waits only ever grow: a fast machine runs
with 1.
"""

from __future__ import annotations

import os
import statistics
import time

ENV = "RAY_ATTN_TEST_TIME_SCALE"
MAX_SCALE = 10.0
_REFERENCE_S = 0.011  # _workload() on an idle core of the 2-core development machine


def _workload() -> float:
    t0 = time.perf_counter()
    x = 0
    for i in range(300_000):
        x += i * i % 7
    return time.perf_counter() - t0


def measure() -> float:
    """The factor for this machine now (see the module docstring)."""
    cpus = os.cpu_count() or 1
    load = os.getloadavg()[0] / cpus if hasattr(os, "getloadavg") else 0.0
    speed = statistics.median(_workload() for _ in range(5)) / _REFERENCE_S
    return min(MAX_SCALE, max(1.0, load, speed))


def cpu_ticks() -> tuple[int, int]:
    """``/proc/stat``'s ticks since boot, summed over the cores: (all, idle + iowait).  Raises
    OSError where there is no ``/proc/stat``."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields), fields[3] + (fields[4] if len(fields) > 4 else 0)


def busy_cpus(window_s: float = 0.3) -> float:
    """How many CPUs other processes keep busy now (this one sleeps while it samples): the
    non-idle share of ``/proc/stat``'s ticks over ``window_s``, times the CPU count; 0 where
    there is no ``/proc/stat``.  A load average lags by a minute: a hog started with the run is
    seen here at once."""
    try:
        total0, idle0 = cpu_ticks()
        time.sleep(window_s)
        total1, idle1 = cpu_ticks()
    except (OSError, ValueError, IndexError):
        return 0.0
    if total1 <= total0:
        return 0.0
    return (1.0 - (idle1 - idle0) / (total1 - total0)) * (os.cpu_count() or 1)


def _from_env() -> float | None:
    raw = os.environ.get(ENV)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENV}={raw!r}: not a number") from None
    if not 1.0 <= value <= 100.0:
        raise ValueError(f"{ENV}={raw!r}: must be in [1, 100]")
    return value


TIME_SCALE: float = _from_env() or measure()
os.environ[ENV] = f"{TIME_SCALE:.2f}"


def scaled(seconds: float) -> float:
    """``seconds`` (right for an idle machine) stretched for this one."""
    return seconds * TIME_SCALE


def wait_for(pred, timeout: float, every: float = 0.1):
    """``pred()`` once truthy, polling for up to ``timeout`` seconds (scaled); its last value."""
    deadline = time.monotonic() + scaled(timeout)
    while True:
        value = pred()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(every)
