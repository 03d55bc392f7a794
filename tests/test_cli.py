"""``ray-attn`` refuses bad arguments with one line naming the field (argparse's exit 2), never a
pydantic traceback, and a GPU request on a cluster without GPUs fails at once instead of waiting
for a placement group that can never be placed."""

from __future__ import annotations

import pytest

from ray_attn.cli import main
from tests.timescale import scaled


@pytest.mark.parametrize("argv,line", [
    # The demo's real model (SmolLM2-135M-Instruct: 9 query heads) and its Llama-4-style part (4 heads).
    (["demo", "--tp", "2"], "ray-attn: error: tensor_parallel_size=2 must divide num_attention_heads=9"),
    (["demo", "--tp", "0"], "ray-attn: error: tensor_parallel_size: Input should be greater than 0"),
    (["demo", "--part", "llama4", "--llama4-tp", "3"],
     "ray-attn: error: tensor_parallel_size=3 must divide num_attention_heads=4"),
    (["demo", "--checkpoint", "/nonexistent/m.gguf"],
     "ray-attn: error: checkpoint='/nonexistent/m.gguf': GGUF checkpoint "
     "'/nonexistent/m.gguf' does not exist"),
    (["serve", "/nonexistent/m.gguf"], "ray-attn: error: model: GGUF checkpoint '/nonexistent/m.gguf' does not exist"),
])
def test_bad_arguments_get_one_line(argv, line, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == line and not any("Traceback" in x or "pydantic" in x for x in err)


@pytest.mark.slow
def test_cuda_on_a_cluster_without_gpus_fails_at_once(capsys):
    import ray
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    started = not ray.is_initialized()
    try:
        with pytest.raises(SystemExit) as e:
            main(["demo", "--device", "cuda", "--num-blocks", "64"])
    finally:
        if started and ray.is_initialized():
            ray.shutdown()
    assert e.value.code == 2
    assert "parallel.device='cuda' needs 3 GPU(s)" in capsys.readouterr().err


class Serving:
    """``ray-attn serve ARGV`` in a subprocess on ``port`` (its own Ray cluster), started at
    once; ``url()`` waits until it answers /v1/models.  ``interrupt`` + ``stop``: SIGINT, and the
    CLI shuts Serve and its own Ray cluster down.  Its output goes to a file (read when it dies):
    a pipe nobody reads while the other server's test runs could fill and stall it."""

    def __init__(self, log_path, port: int, *argv: str):
        import os
        import subprocess
        import sys
        from pathlib import Path

        self.port = port
        repo = Path(__file__).resolve().parents[1]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]),
                   RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1")
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "ray_attn.cli", "serve", *argv, "--port", str(self.port)],
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT, text=True)

    def output(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def url(self) -> str:
        import time

        import httpx

        deadline = time.monotonic() + scaled(300)
        while True:
            assert self.proc.poll() is None, self.output()
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/v1/models", timeout=scaled(5)).status_code == 200:
                    return f"http://127.0.0.1:{self.port}/v1"
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.5)

    def interrupt(self) -> None:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)

    def stop(self) -> None:
        import subprocess

        self.interrupt()
        try:
            self.proc.wait(scaled(90))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def tiny_qwen3_folder(folder):
    """A tiny random Qwen3 as transformers writes it, with the test tokenizer and its chat
    template in the folder; the HF model and the tokenizer as loaded from there."""
    import transformers

    from tests.model.test_families import reinit
    from tests.tokenizer_fixture import EOS_ID, build_tokenizer

    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=512, eos_token_id=EOS_ID,
        bos_token_id=None)).eval()
    reinit(hf, seed=6, norm_offset=False)
    hf.save_pretrained(str(folder))
    build_tokenizer(folder, 512)
    return hf, transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


@pytest.fixture(scope="module")
def cli_servers(tmp_path_factory):
    """Both tests' ``ray-attn serve`` subprocesses, each with its own Ray, launched before either
    is waited on: their start-ups (mostly Ray's and Serve's, bound by waiting) overlap instead of
    running one after the other.  Each test waits for its own server, so a server that fails to
    start fails its own test with its output."""
    root = tmp_path_factory.mktemp("cli_serve")
    folder = root / "tiny-qwen3"
    hf, tok = tiny_qwen3_folder(folder)
    (root / "gguf").mkdir()
    gguf = tiny_chat_gguf(root / "gguf")
    from ray_attn.ports import loopback_ports

    ports = loopback_ports(2)  # together: asked one at a time, the second may repeat the first
    servers = {"folder": Serving(root / "folder.log", ports[0], str(folder), "--device", "cpu", "--tp", "1",
                                 "--max-num-seqs", "4"),
               "gguf": Serving(root / "gguf.log", ports[1], str(gguf), "--device", "cpu", "--tp", "2",
                               "--max-num-seqs", "4")}
    try:
        yield {"folder": (servers["folder"], hf, tok), "gguf": (servers["gguf"], gguf)}
    finally:
        for s in servers.values():  # both SIGINTs first: the two shutdowns overlap as well
            s.interrupt()
        for s in servers.values():
            s.stop()


def chat_matches_hf(url, model_id, tok, hf, eos_id, max_model_len):
    """One greedy chat completion through the openai client: HF's greedy continuation of the
    templated prompt, decoded by the same tokenizer."""
    import openai
    import torch

    with openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=scaled(120)) as c:
        [card] = c.models.list().data
        assert card.id == model_id and card.model_extra["max_model_len"] == max_model_len
        msgs = [{"role": "user", "content": "hello world"}]
        out = c.chat.completions.create(model=model_id, messages=msgs, max_tokens=10, temperature=0,
                                        extra_body={"return_token_ids": True})
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    ids = torch.tensor([list(ids["input_ids"] if hasattr(ids, "keys") else ids)])
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                           eos_token_id=eos_id, pad_token_id=0)[0, ids.shape[1]:].tolist()
    choice = out.choices[0]
    assert choice.model_extra["token_ids"] == want
    assert choice.message.content == tok.decode(want, skip_special_tokens=True)
    assert choice.finish_reason == ("stop" if want[-1] == eos_id else "length")


@pytest.mark.slow
def test_serve_a_transformers_checkpoint_folder_with_the_openai_client(cli_servers):
    """``ray-attn serve FOLDER``: the folder alone gives the shapes (config.json), the EOS and the
    tokenizer with its chat template; a chat completion through the openai client is HF's greedy
    continuation of the templated prompt."""
    from tests.tokenizer_fixture import EOS_ID

    server, hf, tok = cli_servers["folder"]
    chat_matches_hf(server.url(), "tiny-qwen3", tok, hf, EOS_ID, 512)


def tiny_chat_gguf(folder):
    """A tiny random Llama as a GGUF holding its tokenizer and ChatML template (tests/model/gguf_fixture.py)."""
    import transformers

    from tests.model.gguf_fixture import tiny_hf, write_gguf
    from tests.tokenizer_fixture import CHATML, build_tokenizer

    build_tokenizer(folder / "tok", 512)
    tok = transformers.AutoTokenizer.from_pretrained(str(folder / "tok"), local_files_only=True)
    return write_gguf(tiny_hf("llama", seed=4, vocab_size=512, max_position_embeddings=512), folder / "tiny-chat.gguf",
                      "Q8_0", tokenizer=tok, chat_template=CHATML)


@pytest.mark.slow
def test_serve_a_gguf_file_with_the_openai_client(cli_servers):
    """``ray-attn serve x.gguf`` at TP=2: config, EOS, tokenizer and chat template all from the
    file's metadata; the answer is HF transformers' greedy one on the same GGUF."""
    import torch
    import transformers

    from ray_attn.gguf_file import load_tokenizer
    from tests.tokenizer_fixture import EOS_ID

    server, path = cli_servers["gguf"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    chat_matches_hf(server.url(), "tiny-chat.gguf", load_tokenizer(str(path)), hf, EOS_ID, 512)


def test_serve_config_of_a_gguf_and_of_no_checkpoint(tmp_path):
    """A GGUF file or a folder of one is the checkpoint, and its own tokenizer; no checkpoint at
    all serves the embedded SmolLM2-135M-Instruct GGUF, with its tokenizer, under its name."""
    import argparse

    from ray_attn.presets import default_gguf
    from ray_attn.serve.cli import add_arguments, serve_config

    p = argparse.ArgumentParser()
    add_arguments(p)
    path = tiny_chat_gguf(tmp_path)
    for given in (str(path), str(tmp_path)):
        cfg = serve_config(p.parse_args([given, "--tp", "2"]))
        assert cfg.engine.checkpoint == given and cfg.tokenizer_folder() == str(path)
        assert (cfg.engine.model.num_attention_heads, cfg.engine.parallel.tensor_parallel_size) == (4, 2)
    assert serve_config(p.parse_args([str(path), "--tokenizer", str(tmp_path / "tok")])).tokenizer_folder() == \
        str(tmp_path / "tok")
    default = serve_config(p.parse_args([]))
    assert default.engine.checkpoint == default_gguf() == default.tokenizer_folder()
    assert default.model_id() == "SmolLM2-135M-Instruct"
    assert (default.engine.model.architecture, default.engine.model.num_hidden_layers) == ("LlamaForCausalLM", 30)


def test_serve_flags_for_replicas_resumption_and_spreading():
    import argparse

    from ray_attn.serve.cli import add_arguments, serve_config

    p = argparse.ArgumentParser()
    add_arguments(p)
    plain = serve_config(p.parse_args([]))
    assert (plain.num_replicas, plain.resume_requests, plain.replica_resource) == (None, False, None)
    cfg = serve_config(p.parse_args(["--num-replicas", "3", "--resume-requests",
                                     "--replica-resource", "ray_attn_replica"]))
    assert (cfg.num_replicas, cfg.resume_requests, cfg.replica_resource) == (3, True, "ray_attn_replica")
    from ray_attn.serve.app import deployment_options

    assert deployment_options(cfg)["placement_group_bundles"][0]["ray_attn_replica"] == 1


def test_serve_flags_for_kv_tiers():
    import argparse

    from ray_attn.serve.cli import add_arguments, serve_config

    p = argparse.ArgumentParser()
    add_arguments(p)
    plain = serve_config(p.parse_args([])).engine.cache
    assert (plain.host_cache_gib, plain.kv_sharing) == (0.0, False)
    cache = serve_config(p.parse_args(["--host-cache-gib", "2.5", "--kv-sharing"])).engine.cache
    assert (cache.host_cache_gib, cache.kv_sharing) == (2.5, True)


def test_serve_flag_for_batch_invariant_mode():
    """`ray-attn serve --batch-invariant` (vLLM's VLLM_BATCH_INVARIANT=1) sets the mode, whose
    cascade runs on its grid (planner/invariant.py)."""
    import argparse

    from ray_attn.planner.invariant import cascade_grid
    from ray_attn.serve.cli import add_arguments, serve_config

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert not serve_config(p.parse_args([])).engine.parallel.batch_invariant
    engine = serve_config(p.parse_args(["--batch-invariant"])).engine
    assert engine.parallel.batch_invariant and cascade_grid(engine) == 1024
