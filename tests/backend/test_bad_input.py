"""Rejected calls raise a clear error naming the bad value, and leave the KV cache untouched."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from ray_attn.backend import AttentionLayer, FlashAttentionBackend, FlashAttentionImpl
from ray_attn.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from tests.backend.batch import make_batch

H, HK, D, BS = 8, 2, 64, 16


def impl(**kw):
    args = dict(num_heads=H, head_size=D, scale=D ** -0.5, num_kv_heads=HK, alibi_slopes=None,
                sliding_window=None, kv_cache_dtype="auto", dtype=torch.float32, block_size=BS)
    args.update(kw)
    return FlashAttentionImpl(**args)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(blocksparse_params={"x": 1}), ValueError, "block-sparse"),
    (dict(head_size=80), ValueError, "Head size 80"),
    (dict(num_kv_heads=3), ValueError, "num_kv_heads=3"),
    (dict(attn_type="encoder"), NotImplementedError, "encoder"),
    (dict(kv_cache_dtype="int8"), ValueError, "int8"),
    (dict(sliding_window=0), ValueError, "sliding_window"),
    (dict(alibi_slopes=[0.5] * 3), ValueError, "3 entries"),
    (dict(kernel="fa2"), ValueError, "block_size % 256"),
    (dict(kernel="fa3", head_size=96), ValueError, "head sizes"),
    (dict(kernel="fa2", block_size=256, dtype=torch.float16), ValueError, "CUDA"),
    (dict(kernel="nope"), ValueError, "unknown kernel 'nope'"),
])
def test_constructor_rejects(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        impl(**kwargs)


def test_constructor_maps_window_and_softcap():
    i = impl(sliding_window=128, logits_soft_cap=None)
    assert i.sliding_window == (127, 0) and i.logits_soft_cap == 0
    assert impl().sliding_window == (-1, -1)


def test_kv_cache_shape():
    assert FlashAttentionBackend.get_kv_cache_shape(10, 32, 4, 128) == (2, 10, 32, 4, 128)
    with pytest.raises(ValueError, match="block_size=24"):
        FlashAttentionBackend.get_kv_cache_shape(10, 24, 4, 128)
    assert FlashAttentionBackend.get_supported_head_sizes() == [32, 64, 96, 128, 160, 192, 224, 256]


def _case(name, b):
    """Mutate a good batch into a bad one; returns (query, key, value, cache, meta, out, match)."""
    q, k, v, c, m = b.query, b.key, b.value, b.kv_cache, b.meta
    out = torch.empty_like(q)
    r = dataclasses.replace
    if name == "query_heads":
        q = q[:, :4]
        return q, k, v, c, m, torch.empty_like(q), r"query must be \[num_tokens, 8, 64\]"
    if name == "key_tokens":
        return q, k[:-1], v, c, m, out, "key must be"
    if name == "value_heads":
        return q, k, v.repeat(1, 2, 1), c, m, out, "value must be"
    if name == "dtype":
        return q, k.double(), v, c, m, out, "key dtype torch.float64"
    if name == "cache_dtype":
        return q, k, v, c.half(), m, out, "kv_cache dtype"
    if name == "cache_block_size":
        return q, k, v, c[:, :, :8].contiguous(), m, out, "block_size 8"
    if name == "output_shape":
        return q, k, v, c, m, out[:-1], "output must match"
    if name == "too_many_tokens":
        return q, k, v, c, r(m, num_actual_tokens=q.shape[0] + 1), out, "num_actual_tokens"
    if name == "qsl_end":
        qsl = m.query_start_loc.copy(); qsl[-1] -= 1
        return q, k, v, c, r(m, query_start_loc=qsl), out, "ends at"
    if name == "seq_shorter_than_query":
        sl = m.seq_lens.copy(); sl[1] = 2
        return q, k, v, c, r(m, seq_lens=sl), out, "seq_len=2 is shorter"
    if name == "block_out_of_range":
        bt = m.block_table.copy(); bt[0, 0] = 999
        return q, k, v, c, r(m, block_table=bt), out, "block id 999"
    if name == "negative_block":
        bt = m.block_table.copy(); bt[2, 1] = -5
        return q, k, v, c, r(m, block_table=bt), out, "block id -5"
    if name == "slot_out_of_range":
        sm = m.slot_mapping.copy(); sm[0] = 10 ** 6
        return q, k, v, c, r(m, slot_mapping=sm), out, "slot 1000000"
    if name == "max_seq_len":
        return q, k, v, c, r(m, max_seq_len=3), out, "max_seq_len=3"
    if name == "narrow_block_table":
        return q, k, v, c, r(m, block_table=m.block_table[:, :1]), out, "block_table has 1 columns"
    raise AssertionError(name)


@pytest.mark.parametrize("name", ["query_heads", "key_tokens", "value_heads", "dtype", "cache_dtype",
                                  "cache_block_size", "output_shape", "too_many_tokens", "qsl_end",
                                  "seq_shorter_than_query", "block_out_of_range", "negative_block",
                                  "slot_out_of_range", "max_seq_len", "narrow_block_table"])
def test_forward_rejects_and_leaves_cache(name, rng):
    b = make_batch([1, 5, 1], [20, 5, 40], H=H, Hk=HK, D=D, block_size=BS, dtype=torch.float32, gen=rng)
    q, k, v, c, m, out, match = _case(name, b)
    before = c.clone()
    with pytest.raises(ValueError, match=match):
        impl().forward(AttentionLayer(), q, k, v, c, m.to_device("cpu"), out)
    assert torch.equal(c, before), "a rejected call must not write the cache"


@pytest.mark.parametrize("make,match", [
    (lambda: EngineConfig(parallel=ParallelConfig(tensor_parallel_size=3)), "tensor_parallel_size=3"),
    (lambda: EngineConfig(parallel=ParallelConfig(kernel="fa2")), "block_size % 256"),
    (lambda: ModelConfig(hidden_size=320, num_attention_heads=4), "head size 80"),
    (lambda: EngineConfig(model=ModelConfig(attention_chunk_size=40, layer_types=["chunked_attention"] * 4)),
     "attention_chunk_size=40"),
    (lambda: ModelConfig(layer_types=["sliding_attention"] * 4), "sliding_window is not set"),
    (lambda: ModelConfig(layer_types=["full_attention"] * 3), "3 entries"),
    (lambda: EngineConfig(model=ModelConfig(use_alibi=True), parallel=ParallelConfig(kernel="fa3")), "ALiBi"),
    (lambda: EngineConfig(cache=CacheConfig(kv_cache_dtype="fp8", block_size=256),
                          parallel=ParallelConfig(kernel="fa2")), "fp8"),
    (lambda: CacheConfig(block_size=40), "multiple of 16, got 40"),
    (lambda: ParallelConfig(tensor_parallel_size=0), "tensor_parallel_size"),
])
def test_config_rejects_unrunnable(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_config_replicates_kv_heads_when_fewer_than_tp():
    EngineConfig(model=ModelConfig(num_attention_heads=8, num_key_value_heads=2, hidden_size=512),
                 parallel=ParallelConfig(tensor_parallel_size=8))


def test_config_rejects_unknown_fields():
    with pytest.raises(ValueError, match="hidden_sise"):
        ModelConfig(hidden_sise=64)


def test_model_presets_build_and_unknown_names_are_refused():
    from ray_attn.config import MODEL_PRESETS

    for name in MODEL_PRESETS:
        assert ModelConfig.from_name(name) == ModelConfig(**MODEL_PRESETS[name])
    assert ModelConfig.from_name("llama-3-8b", num_hidden_layers=2).num_hidden_layers == 2
    with pytest.raises(ValueError, match="unknown model preset 'llama-9'.*'llama-3-8b'"):
        ModelConfig.from_name("llama-9")
