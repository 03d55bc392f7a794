"""scripts/bench_spec_verify.py end to end at the tiny preset on CPU (its numbers are the H200's to
give): every point ran, the k > 0 ones verified k drafts in every step, the plain point is the
reference, and the real-text ITL is the verify cost over bench_spec_decode.json's acceptance."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))


def test_tiny_on_cpu(tmp_path):
    import bench_spec_verify as bsv

    out = bsv.main(["--preset", "tiny", "--device", "cpu", "--k", "0", "2", "--batch", "1", "2", "--steps", "3",
                    "--ctx", "24", "--rounds", "2", "--json", str(tmp_path / "v.json")])
    assert out["rounds"] == 2
    assert [(p["batch"], p["k"]) for p in out["points"]] == [(1, 0), (1, 2), (2, 0), (2, 2)]
    assert all(p["ratio"] == 1.0 for p in out["points"] if p["k"] == 0)
    assert (tmp_path / "v.json").exists()
    for r in out["real_text"]:
        cost = next(p["ratio"] for p in out["points"] if p["batch"] == 1 and p["k"] == r["k"])
        assert r["itl_vs_plain_drafting_steps"] == pytest.approx(cost / r["acceptance_length"], rel=1e-2)


def test_a_draft_models_steps_on_cpu(tmp_path):
    import bench_spec_verify as bsv

    out = bsv.main(["--preset", "tiny", "--draft-preset", "tiny", "--device", "cpu", "--k", "0", "3", "--batch", "1",
                    "--steps", "3", "--ctx", "24", "--rounds", "1", "--json", str(tmp_path / "v.json")])
    assert out["draft_preset"] == "tiny" and out["real_text"] == []
    assert [(p["batch"], p["k"]) for p in out["points"]] == [(1, 0), (1, 3)]


def test_real_text_itl_weighs_drafting_and_plain_steps(tmp_path, monkeypatch):
    """A request of 10 tokens in 6 steps, 4 of them drafting at cost 1.5: ITL (4 x 1.5 + 2) / 10."""
    import json

    import bench_spec_verify as bsv

    (tmp_path / "bench_spec_decode.json").write_text(json.dumps({"rows": [dict(
        workload="edit", k=2, acceptance_length=2.0, per_request=[dict(tokens=10, steps=6, drafted_steps=4)])]}))
    monkeypatch.setattr(bsv, "RESULTS", tmp_path)
    (r,) = bsv.real_text_itl([dict(batch=1, k=2, ratio=1.5)])
    assert r["itl_vs_plain"] == pytest.approx(0.8) and r["tokens_per_step"] == pytest.approx(10 / 6, abs=0.01)
    assert r["itl_vs_plain_drafting_steps"] == pytest.approx(0.75)


def test_a_point_whose_drafts_did_not_run_is_an_error(tmp_path, monkeypatch):
    import bench_spec_verify as bsv

    monkeypatch.setattr(bsv.ForcedDrafts, "propose", lambda self, tokens, k=None: tokens[:0])
    with pytest.raises(RuntimeError, match="drafts verified"):
        bsv.main(["--preset", "tiny", "--device", "cpu", "--k", "0", "2", "--steps", "2", "--ctx", "16",
                  "--json", str(tmp_path / "v.json")])
