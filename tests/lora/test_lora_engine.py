"""The engine under LoRA adapters against HF peft on the same tiny random Llama (float32, CPU).

Each request's greedy continuation is checked against peft's model for its adapter (the base
model for none), position by position: peft's argmax at every generated position must be our
token, and our log-probability of it peft's within 1e-4 (float32 on both sides, summation order
apart: ~1e-6; an adapter applied to the wrong rows, unscaled or missing moves logits by > 0.1 --
the test checks that too, against the base).
"""

from __future__ import annotations

import pytest
import torch

from ray_attn.engine import LLMEngine, SamplingParams
from ray_attn.lora import LoRARequest
from ray_attn.runtime import InProcessExecutor
from tests.lora.peft_fixture import ADAPTERS, engine_config, hf_logits, peft_model, prompts

ATOL = 1e-4
GREEDY = SamplingParams(max_tokens=6, logprobs=0)


def check_against_peft(base, adapters, outs, names):
    refs = {}
    for out, name in zip(outs, names):
        if name not in refs:
            refs[name] = peft_model(base, None if name is None else adapters[name])
        toks = out.prompt_token_ids + out.output_token_ids
        logp = torch.log_softmax(hf_logits(refs[name], toks), -1)
        n = len(out.prompt_token_ids)
        for i, (t, lp) in enumerate(zip(out.output_token_ids, out.logprobs)):
            row = logp[n + i - 1]
            assert int(row.argmax()) == t, (name, i)
            assert abs(float(row[t]) - lp.logprob) < ATOL, (name, i, float(row[t]), lp.logprob)


def requests_for(adapters, names):
    ids = {name: i + 1 for i, (name, *_) in enumerate(ADAPTERS)}
    return [None if n is None else LoRARequest(n, ids[n], adapters[n]) for n in names]


def test_mixed_batch_of_adapters_and_base_equals_peft(lora_models):
    """Four adapters (every target module among them) and the base in one batch, through
    chunked prefill and decode; two device slots, so adapters wait for and reuse slots."""
    base, adapters = lora_models
    names = ["attn", None, "mlp", "all", None, "qv", "attn", "all"]
    cfg = engine_config(base, max_loras=2, max_num_batched_tokens=48)
    eng = LLMEngine(cfg, InProcessExecutor(cfg))
    outs = eng.generate(prompts(len(names)), GREEDY, lora_request=requests_for(adapters, names))
    check_against_peft(base, adapters, outs, names)
    assert eng.lora.num_loads >= 4  # every adapter was loaded, some after another left its slot
    # the adapters matter: the base model's continuation of the same prompt differs
    plain = eng.generate([outs[0].prompt_token_ids], GREEDY)[0]
    assert plain.output_token_ids != outs[0].output_token_ids


def test_every_target_module_alone_moves_the_logits_as_peft(lora_models, tmp_path):
    """One adapter per target module: each changes the base's logits by > 0.1 and we follow."""
    from tests.lora.peft_fixture import ALL, write_adapter

    base, _ = lora_models
    cfg = engine_config(base, max_loras=len(ALL))
    eng = LLMEngine(cfg, InProcessExecutor(cfg))
    ad = {m: write_adapter(base, tmp_path / m, [m], 4, 8, seed=10 + i) for i, m in enumerate(ALL)}
    reqs = [LoRARequest(m, i + 1, ad[m]) for i, m in enumerate(ALL)]
    p = prompts(1)[0]
    outs = eng.generate([p] * len(ALL), GREEDY, lora_request=reqs)
    check_against_peft(base, ad, outs, ALL)
    base_logits = hf_logits(peft_model(base, None), p)
    for m in ALL:
        assert (hf_logits(peft_model(base, ad[m]), p) - base_logits).abs().max() > 0.1, m


@pytest.mark.slow
def test_tp2_over_ray_equals_peft(shared_ray, lora_models):
    """TP=2 ranks as Ray actors: column-parallel layers cut B's rows, row-parallel ones A's
    columns, the partial updates summed by the layer's all-reduce; the same tokens as peft."""
    base, adapters = lora_models
    names = ["all", None, "attn", "mlp", "qv"]
    eng = LLMEngine(engine_config(base, tp=2, max_loras=4, max_cpu_loras=4))
    try:
        outs = eng.generate(prompts(len(names), seed=6), GREEDY, lora_request=requests_for(adapters, names))
        # An adapter new to the ranks while a base request decodes: both ranks read it on their
        # prefetch threads, and it is admitted once rank 0 reports it.
        eng.add_request(prompts(1, seed=7)[0], SamplingParams(max_tokens=12), request_id="base")
        eng.step()
        before = eng.lora.num_prefetches
        late = LoRARequest("late", 11, adapters["mlp"])
        eng.add_request(prompts(1, seed=8)[0], GREEDY, request_id="late", lora_request=late)
        while eng.has_unfinished_requests():
            eng.step()
        assert eng.lora.num_prefetches == before + 1
        outs.append(eng.output("late"))
    finally:
        eng.shutdown()
    check_against_peft(base, adapters, outs, names + ["mlp"])
