"""``LLMEngine.add_request(output_token_ids=...)``: a request resumed from the tokens a lost
replica streamed gives the tokens the uninterrupted request gives -- greedy, seeded sampling
(whose draws are indexed by the token's position among the outputs), penalties (which count the
resumed tokens), min_tokens and max_tokens -- and bad resumptions are refused by name."""

from __future__ import annotations

import pytest

from ray_attn.engine import LLMEngine, SamplingParams
from ray_attn.runtime import InProcessExecutor
from tests.runtime.test_engine_tp import config, workload

PARAMS = {
    "greedy": SamplingParams(max_tokens=12),
    "seeded": SamplingParams(max_tokens=12, temperature=1.0, seed=7, top_p=0.95),
    "penalised": SamplingParams(max_tokens=12, temperature=0.8, seed=3, repetition_penalty=1.5,
                                frequency_penalty=0.7),
    "min_tokens": SamplingParams(max_tokens=12, temperature=0.9, seed=11, min_tokens=9),
}


def engine(asyn: bool = False) -> LLMEngine:
    cfg = config().model_copy(update={"async_scheduling": asyn})
    return LLMEngine(cfg, InProcessExecutor(cfg))


def run(eng: LLMEngine, prompt, params, resumed=()):
    rid = eng.add_request(prompt, params, output_token_ids=resumed)
    while eng.has_unfinished_requests():
        eng.step()
    out = eng.output(rid)
    eng.release(rid)
    return out


@pytest.mark.parametrize("asyn", [False, True])
@pytest.mark.parametrize("kind", list(PARAMS))
def test_resumed_request_continues_as_the_uninterrupted_one(kind, asyn):
    eng = engine(asyn)
    prompt, params = workload()[2], PARAMS[kind]
    full = run(eng, prompt, params)
    assert len(full.output_token_ids) == params.max_tokens
    for cut in (1, 5, params.max_tokens - 1):
        # a fresh engine: nothing of the first run in its prefix cache
        out = run(engine(asyn), prompt, params, full.output_token_ids[:cut])
        assert out.output_token_ids == full.output_token_ids, (kind, cut)
        assert out.prompt_token_ids == list(prompt) and out.finish_reason == full.finish_reason


def test_resumed_request_counts_its_tokens_against_max_tokens_and_stops():
    eng = engine()
    prompt = workload()[0]
    full = run(eng, prompt, SamplingParams(max_tokens=8))
    eos = full.output_token_ids[5]
    first = full.output_token_ids.index(eos)
    stopping = SamplingParams(max_tokens=8, stop_token_ids=(eos,))
    out = run(eng, prompt, stopping, full.output_token_ids[:2])
    assert out.output_token_ids == full.output_token_ids[:first + 1] and out.finish_reason == "stop"
    out = run(eng, prompt, SamplingParams(max_tokens=8), full.output_token_ids[:7])
    assert out.output_token_ids == full.output_token_ids and out.finish_reason == "length"
    assert eng.planner.stats()["num_used_blocks"] == 0


@pytest.mark.parametrize("resumed,params,field", [
    ([1, 2, 3], SamplingParams(max_tokens=3), "leave nothing to generate"),
    ([1, 10**6], SamplingParams(max_tokens=8), "outside the vocabulary"),
    ([1], SamplingParams(max_tokens=8, prompt_logprobs=0), "prompt_logprobs"),
])
def test_bad_resumption_is_refused_by_name(resumed, params, field):
    eng = engine()
    with pytest.raises(ValueError, match="output_token_ids") as e:
        eng.add_request(workload()[0], params, output_token_ids=resumed)
    assert field in str(e.value)
    assert not eng.has_unfinished_requests()


@pytest.mark.gpu
@pytest.mark.parametrize("asyn", [False, True])
def test_resumed_requests_on_the_gpu(asyn):
    """On CUDA (CUDA graphs for the decode steps, async scheduling answering a step late): in
    float32 a resumed request continues exactly as the uninterrupted one; in bfloat16 the
    prefill of prompt + resumed tokens runs other kernels than the decode steps did, so a near
    tie may break the other way -- most continuations still agree, and the agreement is printed."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    prompts = workload(n=8)
    params = [SamplingParams(max_tokens=12, **({"temperature": 1.0, "seed": i} if i % 2 else {}))
              for i in range(len(prompts))]
    for dtype in ("float32", "bfloat16"):
        base = config(dtype=dtype)
        cfg = base.model_copy(update={"async_scheduling": asyn,
                                      "parallel": base.parallel.model_copy(update={"device": "cuda"})})
        eng = LLMEngine(cfg, InProcessExecutor(cfg))
        full = eng.generate(prompts, params)
        resumed = LLMEngine(cfg, InProcessExecutor(cfg))  # fresh: nothing of the first run cached
        ids = [resumed.add_request(p, sp, output_token_ids=o.output_token_ids[:4])
               for p, sp, o in zip(prompts, params, full)]
        while resumed.has_unfinished_requests():
            resumed.step()
        same = 0
        for rid, o in zip(ids, full):
            out = resumed.output(rid)
            assert out.output_token_ids[:4] == o.output_token_ids[:4] and len(out.output_token_ids) == 12
            same += out.output_token_ids == o.output_token_ids
        print(f"\n{dtype}: {same}/{len(prompts)} resumed continuations equal the uninterrupted ones")
        assert same == len(prompts) if dtype == "float32" else same >= len(prompts) // 2, (dtype, same)
