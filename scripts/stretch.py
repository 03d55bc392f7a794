"""The scripts' deadlines on a loaded machine, without torch: ``simcluster`` and the multi-node
drivers import this alone (benchlib imports torch, ~2 s on two cores, in every such process)."""

from __future__ import annotations

import os


def stretched(seconds: float) -> float:
    """``seconds`` times the test suite's time scale (``RAY_ATTN_TEST_TIME_SCALE``, which
    tests/timescale.py exports to the scripts it runs): a script's own deadlines, written for an
    idle machine, grow on a loaded one as the tests' do.  Run by hand, the factor is 1."""
    try:
        return seconds * max(1.0, float(os.environ.get("RAY_ATTN_TEST_TIME_SCALE", "1")))
    except ValueError:
        return seconds
