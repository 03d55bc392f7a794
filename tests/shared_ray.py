"""The one local Ray cluster that every test sharing one uses (``shared_ray`` in conftest.py).

Starting an embedded Ray costs 5-20 s on two cores (more beside other work), and each test
module or script run that started its own paid it again.  Tests that need a cluster of another
shape (``tests/cluster``: several raylets) shut this one down and call ``ensure()`` when done.

Its shape is the union of what its users asked for: 8 logical CPUs (a TP=4 group, two TP=2
Serve replicas and their fronts fit), metrics reported every second (``bench_routing.py`` and
the Serve metrics tests read them back), and ``PYTHONPATH`` naming this checkout, which Serve
replicas and Ray workers inherit.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NUM_CPUS = 8
SYSTEM_CONFIG = {"metrics_report_interval_ms": 1000}

_ours = False  # whether the Ray this process is connected to was started here


def ensure() -> None:
    """Connect this process to the shared cluster, starting it if no Ray is up."""
    global _ours
    import ray

    from ray_attn.runtime.cluster import init_local_ray

    if ray.is_initialized():
        return
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p)
    init_local_ray(num_cpus=NUM_CPUS, include_dashboard=False, log_to_driver=False, _system_config=SYSTEM_CONFIG)
    _ours = True


def is_ours() -> bool:
    import ray

    return _ours and ray.is_initialized()


def shutdown() -> None:
    """Stop the shared cluster (a later ``ensure()`` starts a new one)."""
    global _ours
    import ray

    if ray.is_initialized():
        ray.shutdown()
    _ours = False
