"""scripts/servebench/roofline.py: the per-rank costs against the model the engine builds, the
FLOP and KV counts against brute-force float64 sums, decode steps against a simulated schedule,
and the ideal prefix cache against hand-made prompts."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from servebench import roofline as rl  # noqa: E402

from ray_attn.config import ModelConfig  # noqa: E402
from ray_attn.model import build_model  # noqa: E402

SHAPES = {
    "llama-3-8b": ModelConfig.from_name("llama-3-8b"),
    "gqa-replicated": ModelConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                                  num_attention_heads=8, num_key_value_heads=2, dtype="bfloat16"),
    "tied-fp32": ModelConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
}


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_costs_match_the_rank_the_engine_builds(name, tp, kv):
    m = SHAPES[name]
    model = build_model(m, tp_rank=0, tp_size=tp, tp_group=object(), device="meta", kv_cache_dtype=kv)
    c = rl.ModelCosts.from_config(m, tp, kv)
    layer_mats = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.") and p.dim() == 2)
    assert c.layer_params == layer_mats
    assert c.lm_head_params == model.lm_head.numel()
    # every parameter but the embedding table (a gather), the LM head counted even when tied
    el = model.embed_tokens.element_size()
    read = sum(p.numel() for p in model.parameters()) - model.embed_tokens.numel() + (
        model.lm_head.numel() if m.tie_word_embeddings else 0)
    assert c.weight_bytes == read * el
    assert c.kv_bytes_per_token == model.kv_cache_bytes_per_block() // model.block_size
    assert c.attn_flops_per_pair == 4 * model.num_heads * model.head_size * m.num_hidden_layers


@pytest.mark.parametrize("tie", [False, True])
def test_fp8_weight_costs_count_the_bytes_a_loaded_rank_holds(tie):
    """quantization='fp8': e4m3 linears (a byte each) and their float32 row scales, the rest in bf16."""
    m = ModelConfig(vocab_size=300, hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, dtype="bfloat16", tie_word_embeddings=tie, quantization="fp8")
    model = build_model(m, device="cpu", block_size=16, kernel="torch")
    model.init_random_weights(0)
    c = rl.ModelCosts.from_config(m)
    read = sum(p.numel() * p.element_size() for p in model.parameters()) - model.embed_tokens.numel() * 2 + (
        model.lm_head.numel() * 2 if tie else 0)
    assert c.weight_bytes == read
    fp8 = sum(p.numel() for p in model.parameters() if p.dtype == torch.float8_e4m3fn)
    assert fp8 == c.layer_params > 0  # every linear of the layers is e4m3


MOE = dict(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
           num_key_value_heads=2, dtype="bfloat16", num_local_experts=4, moe_intermediate_size=64)
MOE_SHAPES = {
    "qwen3_moe": ModelConfig(architecture="Qwen3MoeForCausalLM", moe_layers=[1, 2], **MOE),
    "llama4": ModelConfig(architecture="Llama4ForCausalLM", moe_layers=[0, 2], **MOE),
    "mixtral": ModelConfig(architecture="MixtralForCausalLM", **(MOE | dict(moe_intermediate_size=None))),
}


@pytest.mark.parametrize("name", list(MOE_SHAPES))
@pytest.mark.parametrize("tp", [1, 2])
def test_moe_costs_match_the_rank_the_engine_builds(name, tp):
    """With every expert picked (top_k = E) a step reads and computes the whole rank; with top-1 a
    batch-1 step reads one expert per sparse layer, a larger batch more, a large batch all of them."""
    full = MOE_SHAPES[name].model_copy(update=dict(num_experts_per_tok=4))
    model = build_model(full, tp_rank=0, tp_size=tp, tp_group=object(), device="meta")
    c = rl.ModelCosts.from_config(full, tp)
    mats = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.") and p.dim() >= 2)
    assert c.layer_params == mats
    read = sum(p.numel() for p in model.parameters()) - model.embed_tokens.numel()
    assert c.weight_bytes == read * 2 == c.step_weight_bytes(64)
    one = rl.ModelCosts.from_config(MOE_SHAPES[name].model_copy(update=dict(num_experts_per_tok=1)), tp)
    sparse = len(full.moe_layer_ids)
    expert = sum(p[0].numel() for n, p in model.named_parameters() if "experts.w" in n) // sparse
    assert c.weight_bytes - one.weight_bytes == 3 * sparse * expert * 2
    assert one.step_weight_bytes(1) == one.weight_bytes
    assert math.isclose(one.step_weight_bytes(10_000), c.weight_bytes)
    assert one.weight_bytes < one.step_weight_bytes(4) < one.step_weight_bytes(64) < c.weight_bytes


def test_gemm_shapes_are_the_layers_weights():
    m = SHAPES["llama-3-8b"]
    for tp in (1, 2):
        model = build_model(m, tp_rank=0, tp_size=tp, tp_group=object(), device="meta")
        layer = model.layers[0]
        want = [tuple(layer.self_attn.qkv_proj.weight.shape), tuple(layer.self_attn.o_proj.weight.shape),
                tuple(layer.mlp.gate_up.weight.shape), tuple(layer.mlp.down.weight.shape)]
        got = [(n_out, k) for _, _, k, n_out in rl.gemm_shapes(m, tp, 64)]
        assert got == want and all(M == 64 for _, M, _, _ in rl.gemm_shapes(m, tp, 64))


def _brute_prefill(c: rl.ModelCosts, n: int, s: int) -> float:
    f = np.float64(0)
    for pos in range(s, n):
        f += 2.0 * c.layer_params + c.attn_flops_per_pair * (pos + 1)
    return float(f + 2.0 * c.lm_head_params)


@pytest.mark.parametrize("n,s", [(1, 0), (17, 0), (1024, 0), (1024, 512), (300, 299), (4096, 16)])
def test_prefill_flops_against_a_token_by_token_sum(n, s):
    c = rl.ModelCosts.from_config(SHAPES["llama-3-8b"])
    assert rl.prefill_flops(c, n, s) == pytest.approx(_brute_prefill(c, n, s), rel=1e-12)


@pytest.mark.parametrize("n,s", [(10, 10), (10, -1), (0, 0)])
def test_prefill_flops_refuses_an_empty_range(n, s):
    with pytest.raises(ValueError, match="start"):
        rl.prefill_flops(rl.ModelCosts.from_config(SHAPES["tied-fp32"]), n, s)


@pytest.mark.parametrize("p,o", [(1, 1), (1024, 128), (7, 2), (4096, 300)])
def test_decode_kv_tokens_and_batch1_itl(p, o):
    want = sum(p + j for j in range(1, o))  # decode token j attends over the prompt and j tokens
    assert rl.decode_kv_tokens(p, o) == want
    c = rl.ModelCosts.from_config(SHAPES["llama-3-8b"])
    if o >= 2:
        per = [(c.weight_bytes + (p + j) * c.kv_bytes_per_token) / 4.0e12 for j in range(1, o)]
        assert rl.itl_roofline_s(c, 4.0e12, p, o) == pytest.approx(np.mean(per), rel=1e-12)


def _simulated_steps(outs: list[int], batch: int) -> int:
    """Decode steps of the best schedule: each step advances up to ``batch`` requests, those with
    the most tokens left first."""
    left = sorted((o - 1 for o in outs), reverse=True)
    steps = 0
    while left and left[0] > 0:
        for i in range(min(batch, len(left))):
            left[i] -= 1
        left = sorted((x for x in left if x > 0), reverse=True)
        steps += 1
    return steps


@pytest.mark.parametrize("batch", [1, 3, 8, 256])
@pytest.mark.parametrize("seed", [0, 1])
def test_workload_roofline_against_a_float64_reference(batch, seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 40))
    prompts = rng.integers(20, 600, n).tolist()
    outs = rng.integers(1, 60, n).tolist()
    starts = [int(rng.integers(0, p)) for p in prompts]
    c = rl.ModelCosts.from_config(SHAPES["gqa-replicated"], 2, "fp8")
    C, G = 3.3e12, 7.0e14
    r = rl.workload_roofline(c, C, G, prompts, outs, starts, batch)
    steps = _simulated_steps(outs, batch)
    dec = sum(o - 1 for o in outs)
    pre = sum(_brute_prefill(c, p, s) for p, s in zip(prompts, starts)) / G
    kv = sum(sum(p + j for j in range(1, o)) for p, o in zip(prompts, outs)) * c.kv_bytes_per_token / C
    decode = max(steps * c.weight_bytes / C, dec * 2.0 * (c.layer_params + c.lm_head_params) / G) + kv
    assert r["decode_steps"] == steps and r["decode_tokens"] == dec
    assert r["prefill_s"] == pytest.approx(pre, rel=1e-12)
    assert r["decode_s"] == pytest.approx(decode, rel=1e-12)
    assert r["roofline_s"] == pytest.approx(pre + decode, rel=1e-12) and r["arrival_bound_s"] == 0
    assert r["roofline_output_throughput"] == pytest.approx(sum(outs) / (pre + decode), rel=1e-12)


def test_arrival_bound_takes_over_when_the_load_is_light():
    c = rl.ModelCosts.from_config(SHAPES["llama-3-8b"])
    C, G = 4.0e12, 8.0e14
    r = rl.workload_roofline(c, C, G, [1024] * 4, [128] * 4, None, 4, last_arrival_s=10.0)
    alone = 10.0 + _brute_prefill(c, 1024, 0) / G + sum(
        (c.weight_bytes + (1024 + j) * c.kv_bytes_per_token) / C for j in range(1, 128))
    assert r["arrival_bound_s"] == pytest.approx(alone, rel=1e-12) and r["roofline_s"] == r["arrival_bound_s"]
    assert r["work_s"] < r["roofline_s"]


@pytest.mark.parametrize("kwargs,needle", [
    (dict(prompt_lens=[10], output_lens=[2, 3]), "as many output lengths"),
    (dict(prompt_lens=[], output_lens=[]), "as many output lengths"),
    (dict(prompt_lens=[10], output_lens=[2], max_batch=0), "max_batch"),
    (dict(prompt_lens=[10], output_lens=[2], starts=[0, 0]), "as many output lengths"),
])
def test_workload_roofline_refuses_bad_inputs(kwargs, needle):
    c = rl.ModelCosts.from_config(SHAPES["tied-fp32"])
    with pytest.raises(ValueError, match=needle):
        rl.workload_roofline(c, 1e12, 1e14, **kwargs)


def test_ideal_prefix_cache_counts_whole_blocks_of_an_earlier_prompts_chain():
    bs = 4
    a, b, x = list(range(8)), list(range(100, 104)), list(range(200, 206))
    prompts = [a + x,            # nothing cached yet
               a + b + [7],      # a's two blocks
               b + a,            # b was seen only after a: a new chain from its first block
               a + b + [7],      # a, then b after a: three blocks; the last token is computed anyway
               a + b,            # the whole prompt cached: its last token is still computed
               a[:3]]            # shorter than a block
    assert rl.computed_starts(prompts, bs) == [0, 8, 0, 12, 11, 0]


def test_ideal_prefix_cache_on_a_prefix_repetition_workload():
    sys.path.insert(0, str(ROOT / "scripts"))
    from servebench.datasets import prefix_repetition_requests

    reqs = prefix_repetition_requests(np.random.default_rng(0), 1000, 20, 64, 16, 4, 8)
    starts = rl.computed_starts([r.prompt for r in reqs], 16)
    # each of the 4 prefixes is computed once; every later prompt finds its 64 tokens
    assert sorted(starts) == [0] * 4 + [64] * 16
    assert math.isclose(sum(r.prompt_len - s for r, s in zip(reqs, starts)), 4 * 64 + 20 * 16)
