"""The accuracy gate (scripts/gpu_accuracy.py) on CPU: tiny checkpoints written by transformers,
the engine with the torch kernel (its rank in this process; on Ray CPU actors through the CLI).  Both sides compute float32 there, so a
correct engine agrees with HF's argmax on (nearly) every token; a gate that passes a broken engine
is worth nothing, so a row with a wrong RoPE base must fail it."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import gpu_accuracy as ga  # noqa: E402


@pytest.fixture(scope="module")
def gate(tmp_path_factory, shared_ray):
    # Each row's rank in this process: the same engine and model, without an actor's start per row.
    # The rows' path through Ray actors, as the script runs them, is test_cli_writes_the_result_file's.
    return ga.Gate(gpu=False, workdir=str(tmp_path_factory.mktemp("ckpt")), executor="in_process")


def rows(gate, *names):
    by = {r.name: r for r in gate.rows()}
    return [by[n] for n in names]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bf16", "cascade_multi_group", "chunked_local", "preemption", "qwen2", "qwen3",
                                  "same_step_sharing", "llama4", "llama4_cascade", "mixtral", "qwen3_moe",
                                  "json_schema", "host_tier", "fp8_weights_online", "fp8_weights_compressed_tensors",
                                  "fp8_weights_w8a16"])
def test_rows_pass_on_cpu_and_the_feature_ran(gate, name):
    (row,) = rows(gate, name)
    res = gate.run(row)
    assert res["passed"], res
    assert res["agreement"] >= 99.0, res  # float32 on both sides: only near-ties may differ
    if name == "cascade_multi_group":
        assert res["stats"]["multi_group_cascade_steps"] > 0
    if name in ("chunked_local", "llama4"):
        assert res["stats"]["local_steps"] > 0
    if name == "llama4_cascade":
        assert res["stats"]["cascade_steps"] > 0
    if name == "preemption":
        assert res["stats"]["preemptions"] > 0
    if name == "same_step_sharing":
        assert res["stats"]["prefix_cache_hit_tokens"] > 0
    if name == "json_schema":
        assert res["json_valid"] == 12
    if name.startswith("fp8_weights"):
        assert res["fp8_linears"] > 0
    if name == "fp8_weights_w8a16":  # its forced kernel (the dequant path on CPU) is put back after it
        from ray_attn.model import fp8

        assert fp8.FORCE == "auto" and row.fp8_kernel == "w8a16" and row.engine["max_num_seqs"] == 1
    if name == "host_tier":
        assert res["stats"]["host_hit_blocks"] > 0 and res["stats"]["onloaded_blocks"] > 0


@pytest.mark.parametrize("name", ["spec_ngram", "spec_ngram_cascade"])
def test_spec_rows_pass_on_cpu_with_drafts_accepted(gate, name):
    (row,) = rows(gate, name)
    res = gate.run(row)
    assert res["passed"], res
    assert res["spec_identical"] == len(gate.prompts[row.prompts]) and res["stats"]["spec_num_accepted_tokens"] > 0, res
    # the plain run's drafts, one run in three wrong at its end: rejections were verified too
    assert res["stats"]["spec_num_draft_tokens"] > res["stats"]["spec_num_accepted_tokens"], res
    if name == "spec_ngram_cascade":
        assert res["stats"]["cascade_steps"] > 0


def test_the_draft_model_row_passes_on_cpu_with_the_target_as_its_draft(gate):
    (row,) = rows(gate, "spec_draft_cascade")
    res = gate.run(row)
    assert res["passed"], res
    s = res["stats"]
    assert res["spec_identical"] == len(gate.prompts[row.prompts]) and s["cascade_steps"] > 0, res
    assert s["spec_num_accepted_tokens"] == s["spec_num_draft_tokens"] > 0, res  # float32: all of them


def test_lora_row_passes_and_the_adapters_moved_the_tokens(gate):
    (row,) = rows(gate, "lora")
    res = gate.run(row)
    assert res["passed"] and res["agreement"] >= 99.0, res
    assert res["lora_shift"] >= ga.lora.MIN_SHIFT, res


def test_lora_row_fails_when_each_prompt_gets_the_other_adapter(gate, monkeypatch):
    """The engine serves "attn"'s prompts under "mlp", "all"'s under "qv", and the other way round:
    each group is then held to the wrong merged model, and the row must fail on agreement."""
    real = ga.lora.requests

    def swapped(adapters, n):
        flip = {"attn": "mlp", "mlp": "attn", "all": "qv", "qv": "all"}
        return real({k: adapters[flip[k]] for k in adapters}, n)
    monkeypatch.setattr(ga.lora, "requests", swapped)
    (row,) = rows(gate, "lora")
    res = gate.run(row)
    assert not res["passed"] and res["agreement"] < res["threshold"], res


@pytest.mark.slow
def test_a_wrong_model_fails_the_gate(gate):
    """RoPE base off by 10x: the engine still runs, but it is not the checkpoint's model."""
    (row,) = rows(gate, "bf16")
    res = gate.run(replace(row, name="wrong_rope", model={"rope_theta": 50000.0}))
    assert not res["passed"] and res["agreement"] < res["threshold"], res


@pytest.mark.slow
def test_a_feature_that_did_not_run_fails_the_row(gate):
    (row,) = rows(gate, "cascade_one_group")
    res = gate.run(replace(row, engine={"enable_cascade": False}))
    assert not res["passed"] and res["note"] == "no cascade step", res


@pytest.mark.slow
def test_cli_writes_the_result_file(tmp_path, shared_ray, monkeypatch, capsys):
    """The script's own main on the run's Ray (a subprocess would start a Ray of its own: ~10 s)."""
    import ray

    out = tmp_path / "acc.json"
    monkeypatch.setattr(sys, "argv", ["gpu_accuracy.py", "--rows", "async_off", "--out", str(out),
                                      "--workdir", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        ga.main()
    stdout = capsys.readouterr().out
    assert e.value.code == 0, stdout[-2000:]
    saved = json.loads(out.read_text())
    assert [x["row"] for x in saved["rows"]] == ["async_off"] and saved["rows"][0]["passed"]
    assert "1/1 rows passed" in stdout
    assert ray.is_initialized(), "a Ray the script did not start stays up"
    assert ga.Gate(gpu=False, workdir=str(tmp_path)).executor == "ray"  # the script's rows ran on Ray actors
