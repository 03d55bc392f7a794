"""What a rank does to its own process: it runs at niceness 0 where the OS allows (Ray starts
workers at 15, which starves a rank beside any busy process), and a rank reports it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def test_unnice_brings_a_niced_process_back_to_zero():
    code = ("import os; os.setpriority(os.PRIO_PROCESS, 0, 15); "
            "from ray_attn.runtime.worker import unnice; print(unnice())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    # lowering niceness needs CAP_SYS_NICE (root has it); without it the rank keeps Ray's 15
    want = 0 if os.geteuid() == 0 else 15
    assert int(out.strip().splitlines()[-1]) == want


def test_unnice_leaves_a_process_at_zero_alone():
    from ray_attn.runtime.worker import unnice

    if os.getpriority(os.PRIO_PROCESS, 0) != 0:
        pytest.skip("this test process is niced")
    assert unnice() == 0


def test_an_in_process_rank_reports_its_niceness():
    from ray_attn.runtime import InProcessExecutor
    from tests.runtime.test_engine_tp import config

    ex = InProcessExecutor(config())
    assert ex.infos[0]["niceness"] == os.getpriority(os.PRIO_PROCESS, 0)
