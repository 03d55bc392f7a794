"""scripts/bench_fusion.py at the tiny presets on CPU (its timings are the H200's to give): a row
per (preset, rows, variant), the fused ops' torch fallbacks agree with the eager layer, and a
wrong fused op fails the numerics check after the JSON is written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

ARGS = ["--device", "cpu", "--preset", "tiny", "tiny-qknorm", "--rows", "1", "3", "--layers", "2",
        "--variants", "eager,triton", "--iters", "2", "--batches", "2"]


def test_tiny_on_cpu(tmp_path):
    import bench_fusion as bf

    out = bf.main(ARGS + ["--json", str(tmp_path / "f.json")])
    saved = json.loads((tmp_path / "f.json").read_text())
    assert saved["rows"] == out["rows"] and {"device", "torch", "date"} <= saved.keys()
    assert [(r["preset"], r["rows"], r["variant"]) for r in out["rows"]] == [
        (p, t, v) for p in ("tiny", "tiny-qknorm") for t in (1, 3) for v in ("eager", "triton")]
    for r in out["rows"]:
        assert "error" not in r and r["numerics_ok"] and r["rel_diff"] < 1e-3
        assert r["us_per_layer"] > 0 and r["layers"] == 2 and r["roofline_us"] > 0
        assert r["weight_bytes_per_layer"] == 2 * 64 * ((4 + 2 * 2) * 16 + 4 * 16 + 2 * 128 + 128)


def test_a_wrong_fused_op_fails_the_numerics_check(tmp_path, monkeypatch):
    import bench_fusion as bf

    # silu dropped: up alone, as if the kernel had lost its activation
    monkeypatch.setattr(bf.fused, "silu_mul", lambda gate_up, quant=False: gate_up.chunk(2, dim=-1)[1].clone())
    with pytest.raises(RuntimeError, match="numerics check failed.*triton: rel diff"):
        bf.main(ARGS + ["--preset", "tiny", "--rows", "3", "--json", str(tmp_path / "f.json")])
    rows = json.loads((tmp_path / "f.json").read_text())["rows"]
    assert [(r["variant"], r["numerics_ok"]) for r in rows] == [("eager", True), ("triton", False)]
