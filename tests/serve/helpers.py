"""Shared pieces of the serve and scripts tests: a light engine config and a workload."""

from __future__ import annotations

import numpy as np

from ray_attn.config import EngineConfig
from ray_attn.serve.schemas import default_engine_config
from tests.tokenizer_fixture import EOS_ID


def engine_config(tp: int = 2, max_num_seqs: int = 4, num_blocks: int = 256, eos: bool = False) -> EngineConfig:
    cfg = default_engine_config()
    data = cfg.model_dump()
    data["parallel"].update(tensor_parallel_size=tp, device="cpu", num_cpus_per_worker=0.5)
    data["cache"].update(num_blocks=num_blocks)
    if eos:  # the Serve tests' tokenizer ends at its <|im_end|>, so their engines do too
        data["model"].update(eos_token_ids=[EOS_ID])
    data.update(max_num_seqs=max_num_seqs, max_num_batched_tokens=512)
    return EngineConfig.model_validate(data)


def workload(n: int = 6, vocab: int = 512, seed: int = 5, max_tokens: int = 8):
    """n requests: prompts sharing a prefix, half greedy and half seeded sampling."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, vocab, 20).tolist()
    reqs = []
    for i in range(n):
        prompt = shared + rng.integers(0, vocab, int(rng.integers(1, 24))).tolist()
        body = {"prompt_token_ids": prompt, "max_tokens": max_tokens - (i % 3)}
        if i % 2:
            body.update(temperature=0.9, seed=100 + i)
        reqs.append(body)
    return reqs


def sampling_params(body: dict):
    from ray_attn.engine import SamplingParams

    return SamplingParams(max_tokens=body.get("max_tokens", 16), temperature=body.get("temperature", 0.0),
                          seed=body.get("seed"), stop_token_ids=tuple(body.get("stop", ())))


def direct_generate(engine, bodies) -> list[list[int]]:
    outs = engine.generate([b["prompt_token_ids"] for b in bodies], [sampling_params(b) for b in bodies])
    return [o.output_token_ids for o in outs]


def teacher_forced_logits(engine: dict, tokens: list[int]) -> np.ndarray:
    """float64 [len(tokens), vocab]: the model's logits at every position of ``tokens`` in one
    prefill, TP=1 on the torch kernel -- the reference the served logprobs are checked against."""
    import torch

    from ray_attn.model import build_model
    from tests.model.steps import BLOCK_SIZE, MAX_BLOCKS, block_rows, make_step

    cfg = EngineConfig.model_validate(engine)
    assert len(tokens) <= BLOCK_SIZE * MAX_BLOCKS
    model = build_model(cfg.model, block_size=BLOCK_SIZE, kernel="torch")
    model.init_random_weights(cfg.model.seed)
    model.allocate_kv_cache(MAX_BLOCKS)
    n = len(tokens)
    meta = make_step(block_rows(1), [0], [n]).to_device(torch.device("cpu"))
    with torch.inference_mode():
        h = model(torch.tensor(tokens), torch.arange(n), meta)
        return model.compute_logits(h, torch.arange(n)).double().numpy()


_HF_FLOAT64: dict = {}


def float64_logprobs(engine: dict, tokens: list[int]) -> np.ndarray:
    """float64 [len(tokens), vocab]: log-softmax of the logits at every position of ``tokens``,
    teacher-forced through HF transformers running the served weights (our seeded random
    checkpoint) in float64 -- independent of our model code, kernels and TP."""
    import json
    import tempfile

    import torch
    import transformers

    from ray_attn.model.registry import save_random_checkpoint

    cfg = EngineConfig.model_validate(engine)
    key = json.dumps(cfg.model.model_dump(mode="json"), sort_keys=True)
    hf = _HF_FLOAT64.get(key)
    if hf is None:
        with tempfile.TemporaryDirectory() as folder:
            save_random_checkpoint(cfg.model, folder, seed=cfg.model.seed)
            hf = getattr(transformers, cfg.model.architecture).from_pretrained(
                folder, attn_implementation="eager", dtype=torch.float64).eval()
        _HF_FLOAT64[key] = hf
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([list(tokens)])).logits[0], -1).numpy()


# ------------------------------------------------------------------- streams (resume tests)
def sse_events(url: str, body: dict, on_event=None, timeout: float = 120.0, resumed: list | None = None):
    """POST ``body`` as a stream; its data events (``[DONE]`` as the string), and the replica that
    began it (``x-replica-id``).  ``on_event(n, replica)`` runs after the n-th event; no progress
    line of the front (``ray_attn/serve/resume.py``) may reach the client.  ``resumed`` collects
    (replica, first event id) of each replica the front resumed the stream on (its SSE comment)."""
    import json

    import httpx

    from ray_attn.serve.sse_client import replica_comment

    events = []
    with httpx.Client(timeout=timeout) as c, c.stream("POST", url, json=body) as r:
        assert r.status_code == 200, r.read()
        replica = r.headers.get("x-replica-id")
        for line in r.iter_lines():
            moved = replica_comment(line)
            if moved is not None:
                if resumed is not None:
                    resumed.append(moved)
                continue
            assert not line.startswith(":"), f"a progress line reached the client: {line!r}"
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
            if on_event is not None:
                on_event(len(events), replica)
    return events, replica


def tokens_of(events) -> list[int]:
    """The token ids of a /v1/generate stream, in order."""
    return [t for e in events if isinstance(e, dict) for t in e.get("token_ids", [])]


def openai_text(events) -> dict[int, dict]:
    """Per choice of an OpenAI stream: its text, token ids, finish and stop reason, role chunks."""
    out: dict[int, dict] = {}
    for e in events:
        if not isinstance(e, dict):
            continue
        for ch in e.get("choices", []):
            o = out.setdefault(ch["index"], {"text": "", "ids": [], "finish": None, "roles": 0, "stop": None})
            if "delta" in ch:
                o["text"] += ch["delta"].get("content") or ""
                o["roles"] += "role" in ch["delta"]
            else:
                o["text"] += ch["text"]
            o["ids"] += ch.get("token_ids") or []
            if ch.get("finish_reason"):
                o["finish"], o["stop"] = ch["finish_reason"], ch.get("stop_reason")
    return out


def wait_deleted(*apps: str, timeout: float = 60.0) -> None:
    """Until none of ``apps`` is listed by Serve any more (``timeout`` scaled): for apps deleted
    with ``serve.delete(name, _blocking=False)``, so that their shutdowns overlap."""
    import time

    from ray import serve

    from tests.timescale import scaled

    deadline = time.monotonic() + scaled(timeout)
    while set(apps) & set(serve.status().applications) and time.monotonic() < deadline:
        time.sleep(0.2)
