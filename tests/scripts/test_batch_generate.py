"""scripts/batch_generate.py: JSONL in, JSONL out in input order, equal to the engine's generate."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ray_attn.engine import LLMEngine
from ray_attn.runtime import InProcessExecutor
from tests.deploy.helpers import direct_generate, engine_config, workload

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "batch_generate.py"


def write_prompts(path: Path, n: int = 10, seed: int = 21) -> list[dict]:
    bodies = workload(n, 512, seed=seed, max_tokens=9)
    bodies[2]["stop"] = [5, 6]
    bodies[1]["seed"] = 0  # a seed like any other: dropped as falsy, the line would draw unseeded
    with open(path, "w") as f:
        for i, b in enumerate(bodies):
            f.write(json.dumps(dict(b, id=f"r{i}")) + "\n")
            if i == 4:
                f.write("\n")  # blank lines are skipped
    return bodies


def reference(bodies: list[dict]) -> list[list[int]]:
    cfg = engine_config(tp=1)
    eng = LLMEngine(cfg, InProcessExecutor(cfg))
    return direct_generate(eng, bodies)


def run(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


def test_in_process_output_in_input_order_equals_generate(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "sub" / "out.jsonl"
    bodies = write_prompts(inp)
    proc = run("--input", inp, "--output", out, "--executor", "in_process", "--max-in-flight", 3)
    assert proc.returncode == 0, proc.stderr
    assert "generate" in proc.stderr  # the tqdm bar
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["requests"] == len(bodies) and summary["errors"] == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(len(bodies)))
    assert [r["id"] for r in rows] == [f"r{i}" for i in range(len(bodies))]
    assert [r["token_ids"] for r in rows] == reference(bodies)
    assert not (tmp_path / "sub" / "out.jsonl.partial").exists()


@pytest.mark.parametrize("line,needle", [
    ('{"prompt_token_ids": [1], "max_tokens": "3"}', ":2: max_tokens: Input should be a valid integer"),
    ('{"prompt_token_ids": [1, 9999]}', ":2: prompt_token_ids[1]: token id 9999 is outside"),
    ('{"prompt_token_ids": []}', ":2: prompt_token_ids: List should have at least 1 item"),
    ('{"prompt_token_ids": [1], "colour": 1}', ":2: colour: unknown field"),
    ('{"prompt": "hello"}', ":2: prompt: text prompts need --tokenizer"),
    ('{"prompt_token_ids": [1, 2', ":2: body: malformed JSON"),
    # Each within the 2048-token context, together over it: the engine would refuse the line
    # mid-run, after earlier lines were already generated.
    (json.dumps({"prompt_token_ids": [1] * 1000, "max_tokens": 1100}),
     ":2: max_tokens: prompt of 1000 tokens + max_tokens=1100 exceeds the model's 2048-token context"),
])
def test_bad_line_stops_before_any_work_naming_line_and_field(tmp_path, line, needle):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"prompt_token_ids": [1, 2, 3]}\n' + line + "\n")
    proc = run("--input", inp, "--output", out, "--executor", "in_process")
    assert proc.returncode == 2
    assert needle in proc.stderr, proc.stderr
    assert not out.exists()
