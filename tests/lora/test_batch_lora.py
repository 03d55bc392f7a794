"""scripts/batch_generate.py with an adapter per line (``lora_path``): each line's tokens equal the
engine's under that adapter, base lines stay the base model's, and a bad adapter fails its line
only, naming it."""

from __future__ import annotations

import json

from ray_attn.engine import LLMEngine, SamplingParams
from ray_attn.lora import LoRARequest
from ray_attn.runtime import InProcessExecutor
from tests.lora.peft_fixture import engine_config, prompts
from tests.scripts.test_batch_generate import read_rows, run_here


def test_an_adapter_per_line(lora_models, tmp_path, capsys):
    base, adapters = lora_models
    cfg = engine_config(base, max_loras=2, max_lora_rank=8)
    (tmp_path / "engine.json").write_text(cfg.model_dump_json())
    names = ["attn", None, "mlp", "qv", None, "attn"]
    ps = prompts(len(names), seed=11)
    with open(tmp_path / "in.jsonl", "w") as f:
        for i, (p, n) in enumerate(zip(ps, names)):
            f.write(json.dumps({"prompt_token_ids": p, "max_tokens": 4, "id": f"r{i}"}
                               | ({} if n is None else {"lora_path": adapters[n], "lora_name": n})) + "\n")
        f.write(json.dumps({"prompt_token_ids": ps[0], "max_tokens": 4, "id": "bad", "lora_path": adapters["all"],
                            "lora_name": "big"}) + "\n")  # rank 16 > 8
    proc = run_here(capsys, "--input", tmp_path / "in.jsonl", "--output", tmp_path / "out.jsonl", "--config",
                    tmp_path / "engine.json", "--executor", "in_process", "--no-progress", "--max-in-flight", 3)
    assert proc.returncode == 1, proc.stderr[-3000:]  # one line failed: the run says so
    assert json.loads(proc.stdout.strip().splitlines()[-1])["errors"] == 1
    rows = sorted(read_rows(tmp_path / "out.jsonl"), key=lambda r: r["index"])
    eng = LLMEngine(cfg, InProcessExecutor(cfg))
    ids = {n: i + 1 for i, n in enumerate(dict.fromkeys(x for x in names if x))}
    want = eng.generate(ps, SamplingParams(max_tokens=4),
                        lora_request=[None if n is None else LoRARequest(n, ids[n], adapters[n]) for n in names])
    assert [r["token_ids"] for r in rows[:-1]] == [o.output_token_ids for o in want]
    assert rows[-1]["finish_reason"] == "error" and "'big'" in rows[-1]["error"] and "max_lora_rank" in rows[-1]["error"]
