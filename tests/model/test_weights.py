"""Checkpoints: sharded round trip at every TP slicing, the profiling run, and clear load errors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from ray_attn.config import ModelConfig
from ray_attn.model import LlamaForCausalLM, save_random_checkpoint

# tp_size > 1 without collectives: loading and slicing never all-reduce, so a placeholder group does.
NO_COLLECTIVES = object()


def config(**kw) -> ModelConfig:
    base = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64)
    return ModelConfig(**(base | kw))


def model(cfg, tp=1, rank=0, **kw):
    return LlamaForCausalLM(cfg, tp_rank=rank, tp_size=tp,
                            tp_group=NO_COLLECTIVES if tp > 1 else None, **kw)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sharded_checkpoint_round_trip_at_every_tp_slice(tmp_path, dtype):
    cfg = config(dtype=dtype)
    save_random_checkpoint(cfg, str(tmp_path), seed=5, num_shards=3)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    for tp in (1, 2, 4):  # TP=4 replicates the 2 KV heads
        for rank in range(tp):
            loaded, fresh = model(cfg, tp, rank), model(cfg, tp, rank)
            loaded.load_weights(str(tmp_path))
            fresh.init_random_weights(5)
            for (name, a), (_, b) in zip(loaded.named_parameters(), fresh.named_parameters()):
                assert a.dtype == getattr(torch, dtype)
                assert torch.equal(a, b), f"tp={tp} rank={rank} {name}"


def test_replicated_kv_heads_are_sliced_by_rank_group(tmp_path):
    cfg = config(num_key_value_heads=2)
    save_random_checkpoint(cfg, str(tmp_path), seed=6)
    k_full = load_file(str(tmp_path / "model.safetensors"))["model.layers.0.self_attn.k_proj.weight"]
    for rank in range(4):
        m = model(cfg, 4, rank)
        m.load_weights(str(tmp_path))
        assert (m.num_heads, m.num_kv_heads) == (1, 1)
        k_local = m.weight_shards()["model.layers.0.self_attn.k_proj.weight"].dest
        assert torch.equal(k_local, k_full[(rank // 2) * 32:(rank // 2 + 1) * 32])


def _rewrite(folder, fn):
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path)


def test_wrong_shape_names_the_tensor(tmp_path):
    save_random_checkpoint(config(num_key_value_heads=2), str(tmp_path), seed=0)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \(64, 64\).*\(32, 64\)"):
        model(config(num_key_value_heads=1)).load_weights(str(tmp_path))


def test_missing_and_unexpected_tensors(tmp_path):
    cfg = config()
    save_random_checkpoint(cfg, str(tmp_path), seed=0)
    _rewrite(tmp_path, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*model\.layers\.1\.mlp\.down_proj\.weight"):
        model(cfg).load_weights(str(tmp_path))
    save_random_checkpoint(cfg, str(tmp_path), seed=0)
    _rewrite(tmp_path, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(128)}))
    with pytest.raises(ValueError, match=r"does not use.*q_proj\.bias"):
        model(cfg).load_weights(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        model(cfg).load_weights(str(tmp_path / "nowhere"))


def test_tied_checkpoint_has_no_lm_head_and_ignores_one(tmp_path):
    cfg = config(tie_word_embeddings=True)
    save_random_checkpoint(cfg, str(tmp_path), seed=0)
    assert "lm_head.weight" not in load_file(str(tmp_path / "model.safetensors"))
    _rewrite(tmp_path, lambda t: t.update({"lm_head.weight": torch.zeros(64, 64)}))
    m = model(cfg)
    m.load_weights(str(tmp_path))
    assert m.lm_head is m.embed_tokens and m.lm_head.abs().sum() > 0


def test_profiling_run_cache_sizes_and_kernel():
    cfg = config(num_hidden_layers=3)
    m = model(cfg)
    m.init_random_weights(0)
    assert m.kernel_name == "torch"
    hidden = m(torch.arange(10), torch.arange(10), None)  # no cache, no metadata: profiling
    assert hidden.shape == (10, 64) and torch.isfinite(hidden).all()
    m = model(cfg, 4, 1, block_size=32, kv_cache_dtype="fp8")
    assert m.kv_cache_bytes_per_block() == 3 * 2 * 32 * 1 * 32 * 1  # layers, K+V, block, 1 kv head, fp8
    m.allocate_kv_cache(5)
    assert [tuple(c.shape) for c in m.kv_caches] == [(2, 5, 32, 1, 32)] * 3
    assert m.kv_caches[0].dtype == torch.float8_e4m3fn


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="multiple of block_size"):
        model(config(layer_types=["chunked_attention"] * 2, attention_chunk_size=48), block_size=32)
    with pytest.raises(RuntimeError, match="allocate_kv_cache"):
        from tests.model.steps import make_step, block_rows
        m = model(config())
        m(torch.arange(3), torch.arange(3), make_step(block_rows(1), [0], [3]).to_device("cpu"))
