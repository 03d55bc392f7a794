"""``ray-attn demo``'s real-model part: chat questions through TP Ray workers, every answer
checked against a single-process run and HF transformers on the same GGUF -- here on a tiny
random Llama GGUF holding a tokenizer and chat template (the embedded SmolLM2 runs in
``make demo`` and tests/model/test_smollm2.py) -- and the fork rule that lets two exact float32
runs part only at a near-tie."""

from __future__ import annotations

import pytest
import torch

from ray_attn.demo import TIE, compare


def test_compare_takes_equal_answers_and_forks_at_near_ties_only():
    scores = [torch.tensor([0.0, 5.0, 5.0 - TIE / 2, 1.0]), torch.tensor([3.0, 0.0, 0.0, 2.0])]
    assert compare([1, 0], [1, 0], scores) == (True, "same")
    ok, msg = compare([2, 3], [1, 0], scores)  # HF's two picks at token 0 lie TIE/2 apart
    assert ok and "near-tie at token 0" in msg
    ok, msg = compare([1, 3], [1, 0], scores)  # 1 nat apart: a real difference
    assert not ok and "differs at token 1" in msg
    assert compare([1], [1, 0], scores) == (False, "lengths 1 != 2")
    assert compare([2], [1], None) == (False, "differs at token 0")


@pytest.mark.slow
def test_demo_answers_through_tp_workers_match_single_process_and_hf(tmp_path, capsys, shared_ray):
    from ray_attn.cli import main
    from tests.test_cli import tiny_chat_gguf

    path = tiny_chat_gguf(tmp_path)
    rc = main(["demo", "--part", "real", "--checkpoint", str(path), "--tp", "2", "--device", "cpu",
               "--questions", "3", "--answer-tokens", "12", "--json", str(tmp_path / "demo.json")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.count("Q: ") == 3 and out.count("A: ") == 3
    assert out.count("single process: same; HF transformers: same") == 3, out
    import json

    table = json.loads((tmp_path / "demo.json").read_text())["real_model"]
    assert table["tensor-parallel ranks"] == "2" and table["all answers agree"] == "yes"
    assert int(table["tokens generated"]) > 3
