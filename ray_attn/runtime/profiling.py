"""Where one step's time goes on a rank: all-reduce, attention, everything else.

The TP benchmark (``scripts/bench_tp.py``) asks every rank for this split, to tell the cost of
communication from that of compute as the TP size grows.  It is a measurement, not part of
serving a step, so it lives apart from the worker, which only exposes it to Ray.
"""

from __future__ import annotations

from typing import Callable

import torch


def time_by_kernel_kind(run_step: Callable[[], object], device: torch.device) -> dict:
    """Run ``run_step`` once under the torch profiler; its time by kind of kernel, in
    microseconds: device time on CUDA, CPU time on CPU."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        run_step()
        if cuda:
            torch.cuda.synchronize(device)  # the kernels must finish inside the profiled region
    totals = {"all_reduce": 0.0, "attention": 0.0, "other": 0.0}
    for ev in prof.key_averages():
        t = ev.device_time_total if cuda else ev.self_cpu_time_total
        name = ev.key.lower()
        if cuda and "CUDA" not in str(getattr(ev, "device_type", "")):
            continue  # CPU ops: their kernels are counted as kernel events
        if "allreduce" in name or "all_reduce" in name or "nccl" in name:
            totals["all_reduce"] += t
        elif "flash" in name or "attn" in name or "fwd" in name:
            totals["attention"] += t
        elif cuda:
            totals["other"] += t
    return totals
