"""SpeculativeConfig (vLLM's names) and what EngineConfig refuses about it, before any actor
starts, naming the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from ray_attn.config import EngineConfig, ModelConfig, ParallelConfig
from ray_attn.spec_config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig

TARGET = dict(vocab_size=384, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2)


def engine(spec: dict, tp: int = 1, **kw) -> EngineConfig:
    return EngineConfig(model=ModelConfig(**TARGET), parallel=ParallelConfig(tensor_parallel_size=tp, device="cpu"),
                        speculative_config=spec, **kw)


def refused(match: str, spec: dict, **kw) -> None:
    with pytest.raises(ValidationError, match=match):
        engine(spec, **kw)


def test_ngram_defaults_are_vllms():
    cfg = engine({"method": "ngram", "num_speculative_tokens": 3}).speculative_config
    assert cfg.ngram_bounds == (5, 5)
    assert SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=4).ngram_bounds == (4, 4)
    assert SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=2).ngram_bounds == (2, 2)
    assert SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=2, prompt_lookup_max=4).ngram_bounds == (2, 4)


@pytest.mark.parametrize("k", [0, -1, MAX_SPECULATIVE_TOKENS + 1])
def test_k_out_of_range_is_refused(k):
    refused("num_speculative_tokens", {"num_speculative_tokens": k})


def test_bad_lookup_bounds_and_crossed_methods_are_refused():
    refused("prompt_lookup_min=4 is above prompt_lookup_max=2",
            {"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2})
    refused("prompt_lookup_min=0", {"num_speculative_tokens": 2, "prompt_lookup_min": 0})
    refused("model is for method='draft_model'", {"num_speculative_tokens": 2, "model": "/x"})
    refused("needs the draft", {"method": "draft_model", "num_speculative_tokens": 2})
    refused("disable_by_batch_size", {"num_speculative_tokens": 2, "disable_by_batch_size": 0})


def test_async_scheduling_is_taken_with_speculation():
    assert engine({"num_speculative_tokens": 2}, async_scheduling=True).async_scheduling is True


def draft(**over) -> dict:
    return TARGET | dict(hidden_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=256) | over


def test_a_draft_with_another_vocabulary_is_refused():
    refused("the draft's vocab_size=512 differs from the target's vocab_size=384",
            {"method": "draft_model", "num_speculative_tokens": 2, "draft_model_config": draft(vocab_size=512)})


def test_a_draft_whose_heads_tp_does_not_divide_is_refused():
    spec = {"method": "draft_model", "num_speculative_tokens": 2,
            "draft_model_config": draft(hidden_size=192, num_attention_heads=3, num_key_value_heads=1)}
    refused("tensor_parallel_size=2 must divide the draft's num_attention_heads=3", spec, tp=2)
    refused("draft_tensor_parallel_size=1 differs from tensor_parallel_size=2",
            {**spec, "draft_model_config": draft(), "draft_tensor_parallel_size": 1}, tp=2)


def test_a_valid_draft_is_taken_and_a_chunked_attention_draft_refused():
    cfg = engine({"method": "draft_model", "num_speculative_tokens": 2, "draft_model_config": draft()}, tp=2)
    assert cfg.speculative_config.draft_config().num_hidden_layers == 1
    local = draft(num_hidden_layers=2, attention_chunk_size=32, layer_types=["chunked_attention", "full_attention"])
    refused("a draft with chunked .local. attention layers is not supported",
            {"method": "draft_model", "num_speculative_tokens": 2, "draft_model_config": local})
    refused("speculative_config.model='/nowhere'",
            {"method": "draft_model", "num_speculative_tokens": 2, "model": "/nowhere"})


def test_the_default_limit_is_the_devices_measured_break_even():
    from ray_attn.spec_config import CPU_DISABLE_BY_BATCH_SIZE, GPU_DISABLE_BY_BATCH_SIZE, SpeculativeConfig

    auto = SpeculativeConfig(num_speculative_tokens=2)
    assert auto.disable_by_batch_size == "auto"
    assert auto.batch_limit("cpu") == CPU_DISABLE_BY_BATCH_SIZE and auto.batch_limit("cuda:0") == GPU_DISABLE_BY_BATCH_SIZE
    for given in (None, 7):  # an explicit value holds on every device
        spec = SpeculativeConfig(num_speculative_tokens=2, disable_by_batch_size=given)
        assert spec.batch_limit("cpu") == spec.batch_limit("cuda:0") == given
    for bad in (True, "always", -3):
        refused("disable_by_batch_size", {"num_speculative_tokens": 2, "disable_by_batch_size": bad})
    # an engine on CPU ranks reads the limit of the device its rank reported
    from ray_attn.engine import LLMEngine
    from ray_attn.runtime import InProcessExecutor

    cfg = engine({"num_speculative_tokens": 2})
    eng = LLMEngine(cfg, InProcessExecutor(cfg))
    assert eng.spec.disable_by_batch_size == CPU_DISABLE_BY_BATCH_SIZE
