"""scripts/bench_spec_decode.py's main on a tiny setting (one prompt of each workload, a few tokens,
one repeat, batch 2) on the real SmolLM2 GGUF: its rows and sweep are what the README's
table is made of, so they must hold together -- speculation's greedy tokens equal the plain
engine's, the acceptance length is 1 + accepted / drafts of the engine's own counters."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_main_at_a_tiny_setting(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_spec_decode

    out = tmp_path / "spec.json"
    res = bench_spec_decode.main(["--k", "3", "--prompts", "1", "--max-tokens", "8", "--repeats", "1",
                                  "--batch", "2", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["rows"] == json.loads(json.dumps(res["rows"])) and len(saved["sweep"]) == 1
    by = {r["workload"]: r for r in saved["rows"]}
    assert set(by) == {"edit", "chat"}
    edit = by["edit"]
    # the edit prompt's answer repeats it: drafts are accepted (at most k of them a step)
    assert 1 < edit["acceptance_length"] <= 1 + 3 and edit["identical"] == "1/1"
    assert all(r["identical"] == f"{r['requests']}/{r['requests']}" for r in saved["sweep"])
    # the replayed proposer takes the engine's own steps: as many drafting steps as it verified
    # drafts, and tokens - steps accepted tokens (an off-by-one in the replay moves both)
    for r in saved["rows"]:
        assert sum(q["drafted_steps"] for q in r["per_request"]) == r["drafts"]
        assert sum(q["tokens"] - q["steps"] for q in r["per_request"]) == r["accepted"]
    assert saved["break_even_batch"] == bench_spec_decode.break_even(saved["sweep"])


def test_break_even_is_the_last_batch_of_the_paying_run():
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_spec_decode

    rows = [dict(batch=b, speedup=s) for b, s in ((4, 1.05), (1, 1.6), (2, 1.3), (8, 0.9), (16, 1.01))]
    assert bench_spec_decode.break_even(rows) == 4
    assert bench_spec_decode.break_even([dict(batch=1, speedup=0.95)]) is None
