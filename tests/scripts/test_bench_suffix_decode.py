"""scripts/bench_suffix_decode.py at a tiny setting on the real SmolLM2 GGUF (one chat prompt, a
few tokens): its rows hold together, the speculating engines give the plain tokens, and the
second time a request is asked, suffix decoding drafts from its first answer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_main_at_a_tiny_setting(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_suffix_decode

    out = tmp_path / "suffix.json"
    res = bench_suffix_decode.main(["--workloads", "chat", "--methods", "suffix", "--prompts", "1",
                                    "--max-tokens", "12", "--k", "3", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["rows"] == json.loads(json.dumps(res["rows"]))
    by = {(r["method"], r["run"]): r for r in saved["rows"]}
    assert set(by) == {("plain", 1), ("suffix", 1), ("suffix", 2)}
    assert all(r["identical"] == "1/1" for r in saved["rows"] if r["method"] != "plain")
    # asked again, the answer is its first one: up to k + 1 tokens a step
    assert 2.5 <= by["suffix", 2]["acceptance_length"] <= 4, by["suffix", 2]
