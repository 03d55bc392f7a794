"""scripts/bench_lora_load.py at the tiny preset on CPU (its numbers are the machine's to give):
every arrival of the load run read a new adapter into a slot, the control run's resident adapter
was never loaded again (the script refuses a control that loaded), and the goal verdict is the
p99 rule it states."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))


def test_tiny_on_cpu(tmp_path):
    import bench_lora_load as bll

    out = bll.main(["--preset", "tiny", "--device", "cpu", "--clients", "3", "--steps", "8", "--load-every", "2",
                    "--max-loras", "2", "--prompt-len", "16", "--json", str(tmp_path / "l.json")])
    assert out["adapters_loaded"] == 4 and out["slot_loads"] == 4
    for run in ("base_model_arrivals", "control", "with_loads"):
        assert out[run]["steps"] == 8 and 0 < out[run]["p50_ms"] <= out[run]["p99_ms"]
    assert out["goal_met"] == (out["with_loads"]["p99_ms"] <= out["control"]["p99_ms"] + out["one_step_ms"])
    assert (tmp_path / "l.json").exists()
