"""TP=2 and TP=4 compute the same logits as TP=1: gloo process groups on loopback, one process per rank
(dense and MoE families: an MoE rank holds a slice of every expert).

Every rank must also return the full logits itself (the LM head is replicated).  Tolerance 1e-4:
only the all-reduce's summation order differs from TP=1 (observed ~1e-6).
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ray_attn.config import ModelConfig
from ray_attn.model import LlamaForCausalLM, build_model
from tests.model.steps import BLOCK_SIZE, SCHEDULE, random_tokens, run_schedule
from ray_attn.ports import loopback_port as free_port

SEED = 7
CASES = {
    # KV heads split (TP=2), then replicated (TP=4: 2 KV heads over 4 ranks); every layer kind.
    "gqa_mixed": dict(num_key_value_heads=2, sliding_window=8, attention_chunk_size=32,
                      layer_types=["chunked_attention", "sliding_attention", "full_attention"],
                      logits_soft_cap=5.0),
    # One KV head on every rank; ALiBi slopes sliced to each rank's query heads.
    "mqa_alibi": dict(num_key_value_heads=1, use_alibi=True),
    # MPT: the fused Wqkv cut by heads into q, k and v pieces; slopes per rank; LayerNorm, GELU MLP.
    "mpt": dict(architecture="MptForCausalLM", clip_qkv=2.0, intermediate_size=512),
    # Gemma-2: KV heads replicated at TP=4, both soft caps, sliding and full layers, GeGLU.
    "gemma2": dict(architecture="Gemma2ForCausalLM", num_key_value_heads=2, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   logits_soft_cap=4.0, final_logit_soft_cap=5.0, query_pre_attn_scalar=24.0),
    # Qwen2: q/k/v biases cut with their heads; one KV head, so its bias is replicated on every rank.
    "qwen2": dict(architecture="Qwen2ForCausalLM", num_key_value_heads=1, sliding_window=8,
                  layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
    # Qwen3: q/k norms replicated; head_dim 64 (q wider than hidden); KV heads replicated at TP=4.
    "qwen3": dict(architecture="Qwen3ForCausalLM", num_key_value_heads=2, head_dim=64),
    # Llama 4: each rank a slice of every expert's width and of the shared expert's (router
    # replicated); a dense layer between; chunked-local RoPE layers, a NoPE layer with temperature
    # tuning, L2 q/k norm.
    "llama4_moe": dict(architecture="Llama4ForCausalLM", num_local_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=64, moe_layers=[0, 2], no_rope_layers=[1, 1, 0], use_qk_norm=True,
                       attn_temperature_tuning=True, floor_scale=8.0, attention_chunk_size=32,
                       layer_types=["chunked_attention", "chunked_attention", "full_attention"]),
    # Qwen3-MoE: softmax top-2 of 8 renormalised, a dense (mlp_only) first layer, q/k norms.
    "qwen3_moe": dict(architecture="Qwen3MoeForCausalLM", num_local_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=64, moe_layers=[1, 2], norm_topk_prob=True),
}


def config(name: str) -> ModelConfig:
    base = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                num_attention_heads=4, head_dim=32, max_position_embeddings=256)
    return ModelConfig(**(base | CASES[name]))


def logits(name, **tp):
    cfg = config(name)
    model = build_model(cfg, block_size=BLOCK_SIZE, **tp)
    model.init_random_weights(SEED)
    chunk = cfg.attention_chunk_size
    return torch.cat(run_schedule(model, random_tokens(cfg.vocab_size), SCHEDULE, chunk=chunk))


def _rank(rank, world, port, folder):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for name in CASES:
            torch.save(logits(name, tp_rank=rank, tp_size=world, tp_group=dist.group.WORLD),
                       f"{folder}/{name}_{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_matches_single_rank(tp, tmp_path):
    mp.spawn(_rank, args=(tp, free_port(), str(tmp_path)), nprocs=tp, join=True)
    for name in CASES:
        want = logits(name)
        assert want.std() > 0.1
        for rank in range(tp):
            got = torch.load(tmp_path / f"{name}_{rank}.pt")
            assert got.shape == want.shape
            diff = (got - want).abs().max().item()
            assert diff < 1e-4, f"{name} rank {rank}/{tp}: max |diff| {diff}"


def test_tp_size_must_fit_heads():
    with pytest.raises(ValueError, match="must divide num_attention_heads"):
        LlamaForCausalLM(config("mqa_alibi"), tp_rank=0, tp_size=3, tp_group=object())
    with pytest.raises(RuntimeError, match="torch.distributed"):
        LlamaForCausalLM(config("mqa_alibi"), tp_rank=0, tp_size=2)
