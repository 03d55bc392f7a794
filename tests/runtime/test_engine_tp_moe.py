"""A sparse model through the distributed engine: TP=2 and TP=4 Ray actors (gloo all-reduces)
give the single process's greedy tokens.  Llama 4 with random weights: MoE and dense layers,
chunked-local layers whose chunk (32) the prompts cross, a NoPE layer with temperature tuning."""

from __future__ import annotations

import numpy as np
import pytest

from ray_attn.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from ray_attn.engine import LLMEngine, SamplingParams
from ray_attn.runtime import InProcessExecutor

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_tokens=10)


def config(tp=1):
    m = ModelConfig(architecture="Llama4ForCausalLM", vocab_size=256, hidden_size=128, intermediate_size=256,
                    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, moe_layers=[0, 2],
                    no_rope_layers=[1, 1, 0], use_qk_norm=True, attn_temperature_tuning=True, floor_scale=8.0,
                    attention_chunk_size=32, layer_types=["chunked_attention", "chunked_attention", "full_attention"],
                    max_position_embeddings=512, seed=7)
    return EngineConfig(model=m, cache=CacheConfig(num_blocks=96),
                        parallel=ParallelConfig(tensor_parallel_size=tp, device="cpu", num_cpus_per_worker=1),
                        max_num_batched_tokens=128, max_num_seqs=8)


def workload(vocab=256):
    rng = np.random.default_rng(5)
    return [rng.integers(0, vocab, n).tolist() for n in (5, 29, 40, 70, 150)]


@pytest.fixture(scope="module")
def single_process():
    cfg = config()
    eng = LLMEngine(cfg, InProcessExecutor(cfg))
    toks = [o.output_token_ids for o in eng.generate(workload(), GREEDY)]
    assert eng.stats.local_steps > 0
    assert len({tuple(t) for t in toks}) > 1 and all(len(set(t)) > 1 for t in toks), toks
    return toks


@pytest.mark.parametrize("tp", [2, 4])
def test_moe_greedy_tokens_match_single_process(ray_local, single_process, tp):
    eng = LLMEngine(config(tp))
    try:
        assert [o.output_token_ids for o in eng.generate(workload(), GREEDY)] == single_process
        assert eng.stats.local_steps > 0
    finally:
        eng.shutdown()
