"""On a GPU, in bf16: a batch of 8 requests over 4 adapters and the base model, decode replayed
from CUDA graphs (the adapter slot an input of the captured Triton shrink/expand), against peft's
merged model for each adapter in bf16.

Bound: bf16 rounds every activation (2^-8 relative), so the two runs part at near-ties; at each of
our greedy tokens peft's log-probability of it must lie within 0.1 of its best (a slot mix-up or
a missing part moves it by whole units), and at least 90% of the positions must agree exactly."""

from __future__ import annotations

import pytest
import torch

from ray_attn.config import CacheConfig, EngineConfig, ParallelConfig
from ray_attn.engine import LLMEngine, SamplingParams
from ray_attn.lora import LoRAConfig, LoRARequest
from ray_attn.runtime import InProcessExecutor
from tests.lora.peft_fixture import ADAPTERS, peft_model, prompts, tiny_model, write_adapter, write_base

pytestmark = pytest.mark.gpu


def tiny_base_and_adapters(tmp_path):
    """A 4-layer random Llama (head size 64) and the fixture's adapters on it, in PEFT's format."""
    model = tiny_model(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, num_hidden_layers=4, vocab_size=512)
    base = write_base(tmp_path / "base", model)
    return base, {name: write_adapter(base, tmp_path / name, t, r, a, rs, seed=i)
                  for i, (name, t, r, a, rs) in enumerate(ADAPTERS)}


def bf16_config(base, lora: LoRAConfig) -> EngineConfig:
    return EngineConfig(checkpoint=base, model={"dtype": "bfloat16"}, cache=CacheConfig(num_blocks=256),
                        parallel=ParallelConfig(device="cuda"), lora_config=lora, max_num_seqs=16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_batch_of_8_over_4_adapters_and_base_vs_peft_merged(tmp_path):
    base, adapters = tiny_base_and_adapters(tmp_path)
    cfg = bf16_config(base, LoRAConfig(max_loras=4, max_lora_rank=16))
    eng = LLMEngine(cfg, InProcessExecutor(cfg))
    assert eng.executor.infos[0]["cuda_graphs"], "decode steps must replay CUDA graphs"
    names = ["attn", None, "mlp", "all", "qv", None, "all", "attn"]
    ids = {n: i + 1 for i, (n, *_) in enumerate(ADAPTERS)}
    outs = eng.generate(prompts(8, vocab=512), SamplingParams(max_tokens=16),
                        lora_request=[None if n is None else LoRARequest(n, ids[n], adapters[n]) for n in names])
    check_vs_peft_merged(base, adapters, outs, names)


def check_vs_peft_merged(base, adapters, outs, names) -> None:
    """Each greedy token within 0.1 of peft's best log-probability (bf16, merged), and at least
    90% of them peft's argmax."""
    agree = total = 0
    for out, name in zip(outs, names):
        ref = peft_model(base, None if name is None else adapters[name], dtype=torch.bfloat16, merged=True).cuda()
        toks = out.prompt_token_ids + out.output_token_ids
        with torch.no_grad():
            logp = torch.log_softmax(ref(torch.tensor(toks, device="cuda")[None]).logits[0].float(), -1).cpu()
        n = len(out.prompt_token_ids)
        for i, t in enumerate(out.output_token_ids):
            row = logp[n + i - 1]
            assert float(row.max() - row[t]) < 0.1, (name, i)
            agree += int(row.argmax()) == t
            total += 1
    assert agree >= 0.9 * total, (agree, total)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_adapters_prefetched_while_a_stream_decodes_match_peft(tmp_path):
    """The load path on a GPU: the adapters (four) arrive one by one, new to the rank, while a base
    request decodes from CUDA graphs; the reader process fills the pinned host images, a load
    copies them into one of two slots (four adapters through two host buffers: each reused after
    its copies' event), and every request's tokens match peft's merged model."""
    base, adapters = tiny_base_and_adapters(tmp_path)
    cfg = bf16_config(base, LoRAConfig(max_loras=2, max_lora_rank=16, max_cpu_loras=2))
    ids = {n: i + 1 for i, (n, *_) in enumerate(ADAPTERS)}
    names = [n for n, *_ in ADAPTERS]
    eng = LLMEngine(cfg, InProcessExecutor(cfg))
    rank = eng.executor.worker.lora
    try:
        # A base request decodes throughout: when one ends (the reader process's start alone
        # outlasts a few hundred tiny steps), the next begins, so every adapter arrives while
        # another request runs -- and is prefetched, never read inside a shared step.
        bases = []

        def keep_a_base_running():
            if not bases or eng.output(bases[-1]).finished:
                bases.append(f"base{len(bases)}")
                eng.add_request(prompts(1, vocab=512, seed=9 + len(bases))[0],
                                SamplingParams(max_tokens=200, ignore_eos=True), request_id=bases[-1])

        keep_a_base_running()
        eng.step()
        for name, p in zip(names, prompts(len(names), vocab=512)):
            keep_a_base_running()
            eng.add_request(p, SamplingParams(max_tokens=8), request_id=name,
                            lora_request=LoRARequest(name, ids[name], adapters[name]))
            while not eng.output(name).finished:
                keep_a_base_running()
                eng.step()
        assert eng.lora.num_prefetches == len(names)  # each read while a base request decoded
        assert rank.reader is not None and rank.reader_failed is None
        assert {th for _, th, _, _ in rank.reads} == {"lora-prefetch_0"}
        outs = [eng.output(n) for n in names]
    finally:
        eng.executor.shutdown()
    check_vs_peft_merged(base, adapters, outs, names)
