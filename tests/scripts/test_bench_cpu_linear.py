"""scripts/bench_cpu_linear.py at toy shapes: every row count ran both libraries (and, with
``--packed``, both packed layouts), and ``picked``
is what ``gemv.use_onednn`` chooses for that many rows (the rule the script is there to check)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))


def test_toy_shapes(tmp_path):
    from ray_attn.model import gemv

    if not gemv.CPU_ONEDNN:
        pytest.skip("no oneDNN linear on this build")
    import bench_cpu_linear as bcl

    out = bcl.main(["--rows", "1", "4", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
                    "--intermediate", "48", "--vocab", "100", "--layers", "2", "--repeats", "2",
                    "--packed", "--json", str(tmp_path / "l.json")])
    assert [r["rows"] for r in out["rows"]] == [1, 4]
    for r in out["rows"]:
        assert all(r[f"{lib}_{part}_ms"] > 0 for lib in ("mkl", "onednn", "mkl_packed", "onednn_packed")
                   for part in ("layers", "head"))
        assert r["picked"] == ("mkl" if r["rows"] <= gemv.CPU_MKL_MAX_ROWS else "onednn")
    assert json.loads((tmp_path / "l.json").read_text())["mkl_max_rows"] == gemv.CPU_MKL_MAX_ROWS
