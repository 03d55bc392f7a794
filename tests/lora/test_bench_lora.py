"""scripts/bench_lora.py runs end to end at the tiny preset on CPU (its numbers are the H200's to
report; nothing here asserts a time)."""

from __future__ import annotations

import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def test_bench_lora_tiny_on_cpu(tmp_path):
    sys.path.insert(0, str(SCRIPTS))
    import bench_lora

    out = bench_lora.main(["--preset", "tiny", "--device", "cpu", "--steps", "6", "--batch", "4", "--adapters", "2",
                           "--prompt-len", "16", "--out", str(tmp_path / "r.json")])
    assert out["targets"] == 7 and (tmp_path / "r.json").exists()
    for key in ("batch1_itl_ms", "batch4_over_2_step_ms"):
        assert out[key]["base"] > 0 and out[key]["lora"] > 0
