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


def test_bench_lora_kernels_writes_a_table_the_kernels_read(tmp_path):
    """The tuner (Triton's interpreter on CPU: a subprocess, the flag is read at import) writes one
    setting per projection shape and step size, and ``tuning`` reads back what it wrote."""
    import json
    import subprocess

    from ray_attn.lora import tuning

    out = subprocess.run([sys.executable, str(SCRIPTS / "bench_lora_kernels.py"), "--preset", "tiny", "--layers", "1",
                          "--tokens", "1", "4", "--only", "o", "down", "--budget-s", "1", "--reps", "1", "--write",
                          "--config-dir", str(tmp_path), "--out", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert {(r["proj"], r["tokens"]) for r in report["rows"]} == {(p, t) for p in ("o", "down") for t in (1, 4)}
    table = json.loads((tmp_path / "cpu.json").read_text())["shapes"]
    # tiny: hidden 256, intermediate 512, 4 heads of 64; rank 16
    assert set(table) == {tuning.shape_key(256, 256, 1, 16), tuning.shape_key(512, 256, 1, 16)}
    for by_t in table.values():
        assert set(by_t) == {"1", "4"}
        for cfg in by_t.values():
            tuning.KernelConfig.from_json(cfg)  # valid, or it raises
