"""scripts/batch_generate.py: JSONL in, JSONL out in input order, equal to the engine's generate."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ray_attn.engine import LLMEngine
from ray_attn.runtime import InProcessExecutor
from tests.serve.helpers import direct_generate, engine_config, workload
from tests.timescale import scaled

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


def run(*args, timeout=scaled(120)) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


def run_here(capsys, *args) -> subprocess.CompletedProcess:
    """The script's main in this process: replicas on the run's Ray (``shared_ray``) instead of a
    Ray the subprocess starts (~10 s on two cores), and no interpreter start and imports (~2 s a
    run) for the refused inputs.  Its return value is the exit status (``sys.exit(main())``);
    what it prints to stdout and stderr is captured.  The CLI itself (exit status 0 and 2,
    messages on stderr) is run as a subprocess by ``test_in_process_output_...``,
    ``test_the_cli_exits_2_...`` and the killed run."""
    sys.path.insert(0, str(SCRIPT.parent))
    import batch_generate

    capsys.readouterr()
    rc = batch_generate.main([str(a) for a in args])
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["batch_generate.py", *map(str, args)], rc, out.out, out.err)


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
def test_bad_line_stops_before_any_work_naming_line_and_field(tmp_path, line, needle, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"prompt_token_ids": [1, 2, 3]}\n' + line + "\n")
    proc = run_here(capsys, "--input", inp, "--output", out, "--executor", "in_process")
    assert proc.returncode == 2
    assert needle in proc.stderr, proc.stderr
    assert not out.exists()


def test_the_cli_exits_2_naming_line_and_field_on_stderr(tmp_path):
    """One refused input through the command line: its exit status and stderr (the cases above
    call main in this process)."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"prompt_token_ids": [1, 2, 3]}\n{"prompt_token_ids": [1], "colour": 1}\n')
    proc = run("--input", inp, "--output", out, "--executor", "in_process")
    assert proc.returncode == 2
    assert ":2: colour: unknown field" in proc.stderr, proc.stderr
    assert not proc.stdout and not out.exists()


# ------------------------------------------------------------------- several engines, resuming
def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def by_index(rows: list[dict]) -> list[dict]:
    rows = sorted(rows, key=lambda r: r["index"])
    assert [r["index"] for r in rows] == list(range(len(rows))), "each line exactly once"
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("executor,tp", [("in_process", 1), ("ray", 2)])
def test_two_replicas_write_every_record_equal_to_generate(tmp_path, executor, tp, shared_ray, capsys):
    """Two engine replicas (TP=2: each with its own placement group of 1 + 2 bundles): every
    line comes out once, with the engine's tokens, and both replicas took a share."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    bodies = write_prompts(inp, n=10, seed=23)
    proc = run_here(capsys, "--input", inp, "--output", out, "--executor", executor, "--tp", tp, "--replicas", 2,
                    "--max-in-flight", 3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "generate" in proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["replicas"] == 2 and summary["errors"] == 0 and summary["skipped"] == 0
    assert len(summary["requests_per_replica"]) == 2 and min(summary["requests_per_replica"]) >= 1
    assert sum(summary["requests_per_replica"]) == len(bodies)
    rows = by_index(read_rows(out))
    assert [r["id"] for r in rows] == [f"r{i}" for i in range(len(bodies))]
    assert [r["token_ids"] for r in rows] == reference(bodies)
    assert summary["tokens_generated"] == sum(len(r["token_ids"]) for r in rows)


@pytest.mark.slow
def test_resume_keeps_finished_records_and_redoes_the_rest(tmp_path, shared_ray, capsys):
    """An output left by a crash: 4 finished lines (one marked, to prove it is kept, not redone)
    and a torn fifth.  The resumed run, on 2 replicas, adds exactly the missing lines."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    bodies = write_prompts(inp, n=10, seed=24)
    want = reference(bodies)
    done = [2, 7, 0, 5]
    kept = [json.dumps({"index": i, "id": f"r{i}", "token_ids": want[i] if i != 7 else [-7],
                        "text": None, "finish_reason": "length", "error": None,
                        "usage": {"prompt_tokens": 0, "completion_tokens": len(want[i])}}) for i in done]
    head = "".join(line + "\n" for line in kept)
    out.write_text(head + '{"index": 9, "id": "r9", "token_ids": [1, ')  # the crash hit mid-line
    proc = run_here(capsys, "--input", inp, "--output", out, "--executor", "in_process", "--replicas", 2,
                    "--resume", "--max-in-flight", 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["skipped"] == len(done) and sum(summary["requests_per_replica"]) == 10 - len(done)
    assert out.read_text().startswith(head), "finished lines stay as they were"
    rows = by_index(read_rows(out))
    assert rows[7]["token_ids"] == [-7], "a finished line must not be generated again"
    assert [r["token_ids"] for i, r in enumerate(rows) if i != 7] == [w for i, w in enumerate(want) if i != 7]


def test_a_killed_run_resumes_where_it_stopped(tmp_path, capsys):
    """Kill -9 a resumable run (one in-process engine, no Ray) once a few lines are out: every
    line written survives, and --resume finishes the rest with the engine's tokens."""
    import os
    import signal
    import time

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    bodies = write_prompts(inp, n=40, seed=25)
    cmd = [sys.executable, str(SCRIPT), "--input", str(inp), "--output", str(out), "--executor",
           "in_process", "--resume", "--max-in-flight", "1", "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + scaled(120)
        while not (out.exists() and out.read_text().count("\n") >= 3):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no lines written"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(scaled(30))
    finally:
        if proc.poll() is None:
            proc.kill()
    before = out.read_text()
    written = before[:before.rfind("\n") + 1].count("\n")
    assert 3 <= written < len(bodies), "the kill must land mid-run"
    again = run_here(capsys, "--input", inp, "--output", out, "--executor", "in_process", "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout.strip().splitlines()[-1])["skipped"] == written
    assert out.read_text().startswith(before[:before.rfind("\n") + 1])
    assert [r["token_ids"] for r in by_index(read_rows(out))] == reference(bodies)


@pytest.mark.parametrize("existing,lines,needle", [
    (None, ['{"id": "a", "prompt_token_ids": [1]}', '{"id": "a", "prompt_token_ids": [2]}'],
     ":2: id: 'a' repeats line 1"),
    ("not json\n", ['{"prompt_token_ids": [1]}'], "out.jsonl:1: not a result line"),
    ('{"id": "x"}\n', ['{"prompt_token_ids": [1]}'], "out.jsonl:1: not a result line"),
])
def test_resume_refuses_ambiguous_input_and_foreign_output(tmp_path, existing, lines, needle, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    if existing is not None:
        out.write_text(existing)
    proc = run_here(capsys, "--input", inp, "--output", out, "--executor", "in_process", "--resume")
    assert proc.returncode == 2
    assert needle in proc.stderr, proc.stderr
    assert out.read_text() == existing if existing is not None else not out.exists()
