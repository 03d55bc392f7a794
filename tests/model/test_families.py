"""MPT (ALiBi) and Gemma-2 (soft caps, sliding + full layers) against HF transformers.

Parity runs on checkpoints transformers itself wrote (``save_pretrained``), read through
``ModelConfig.from_pretrained`` and the registry, over the chunked-prefill + decode schedule.
Tolerance atol 1e-4 in float32, as in test_hf_parity.py: both sides compute the same math with
different summation orders (fused projections, paged softmax), ~1e-6 apart on logits of order 1,
while a wrong bias, mask, cap or norm moves them by 1e-2 or more.  HF's own 0.02 init would make
attention near-uniform, so ``reinit`` draws 1/sqrt(fan_in) matrices (peaked attention, logits of
order 1) and norm scales near but not at 1.
"""

from __future__ import annotations

import json
from typing import get_args

import pytest
import torch

from ray_attn.config import ARCHITECTURES, Architecture, ModelConfig
from ray_attn.hf_config import READERS, WRITERS
from ray_attn.model import (MODELS, Gemma2ForCausalLM, LlamaForCausalLM, MptForCausalLM, build_model,
                            save_random_checkpoint)
from ray_attn.model.layers import alibi_slopes
from tests.model.steps import BLOCK_SIZE, SCHEDULE, random_tokens, run_schedule
from tests.model.test_hf_parity import assert_close, hf_logits

transformers = pytest.importorskip("transformers")
NO_COLLECTIVES = object()  # tp_size > 1 without collectives: loading never all-reduces


def reinit(hf, seed: int, norm_offset: bool) -> None:
    """Seeded weights with non-trivial scales; ``norm_offset``: the norms scale by 1 + weight."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in hf.named_parameters():  # tied weights appear once
            t = torch.randn(p.shape, generator=g)
            if p.dim() == 1:
                p.copy_(t * 0.05 + (0.0 if norm_offset else 1.0))
            else:
                p.copy_(t * p.shape[-1] ** -0.5)


def hf_checkpoint(hf_cls, hf_config, folder, seed, norm_offset=False):
    hf = hf_cls(hf_config).eval()
    reinit(hf, seed, norm_offset)
    hf.save_pretrained(str(folder))
    return hf


def ours(folder, **kw):
    config = ModelConfig.from_pretrained(str(folder), dtype="float32")
    model = build_model(config, block_size=BLOCK_SIZE, kernel="torch", **kw)
    model.load_weights(str(folder))
    tokens = random_tokens(config.vocab_size)
    return model, tokens, run_schedule(model, tokens, SCHEDULE)


def mpt_config(**attn):
    # expansion_ratio 2: HF ignores it and builds 4 * d_model, and so do we.
    return transformers.MptConfig(d_model=attn.pop("d_model", 128), n_heads=attn.pop("n_heads", 4), n_layers=3,
                                  vocab_size=128, max_seq_len=128, layer_norm_epsilon=1e-5, expansion_ratio=2,
                                  attn_config=attn)


def gemma2_config(**kw):
    base = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                sliding_window=8, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                query_pre_attn_scalar=24, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    return transformers.Gemma2Config(**(base | kw))


# -- parity -----------------------------------------------------------------------------------------
MPT_CASES = {
    "4_heads": {},
    # 6 heads: the non-power-of-2 slope interleave; clipping and a softmax scale of its own.
    "6_heads_clip_scale": dict(d_model=192, n_heads=6, clip_qkv=1.5, softmax_scale=0.1),
}


@pytest.mark.parametrize("case", MPT_CASES)
def test_mpt_matches_hf(case, tmp_path):
    hf = hf_checkpoint(transformers.MptForCausalLM, mpt_config(**MPT_CASES[case]), tmp_path, seed=1)
    model, tokens, got = ours(tmp_path)
    assert isinstance(model, MptForCausalLM) and model.rotary is None
    assert model.config.use_alibi and model.config.tie_word_embeddings
    assert_close(got, hf_logits(hf, tokens))


def test_gemma2_matches_hf(tmp_path):
    hf = hf_checkpoint(transformers.Gemma2ForCausalLM, gemma2_config(), tmp_path, seed=2, norm_offset=True)
    model, tokens, got = ours(tmp_path)
    cfg = model.config
    assert isinstance(model, Gemma2ForCausalLM)
    assert cfg.layer_kinds() == ["sliding_attention", "full_attention"] * 2
    assert max(len(t) for t in tokens) > 4 * cfg.sliding_window  # the window clips
    assert (cfg.logits_soft_cap, cfg.final_logit_soft_cap, cfg.query_pre_attn_scalar) == (2.0, 3.0, 24.0)
    want = hf_logits(hf, tokens)
    assert_close(got, want)
    # The final cap is reached: some logits sit close to it.
    assert torch.cat(want).abs().max() > 0.9 * 3.0


@pytest.mark.parametrize("arch", ["MptForCausalLM", "Gemma2ForCausalLM"])
def test_our_random_checkpoints_load_in_hf(arch, tmp_path):
    """save_random_checkpoint writes each family's config.json and names, scaled so the model is
    alive; init_random_weights is the same model."""
    extra = dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"], head_dim=32,
                 logits_soft_cap=4.0, final_logit_soft_cap=5.0, query_pre_attn_scalar=16.0,
                 num_key_value_heads=2, intermediate_size=256) if arch == "Gemma2ForCausalLM" else \
        dict(clip_qkv=2.0)
    config = ModelConfig(architecture=arch, vocab_size=128, hidden_size=128, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=256, tie_word_embeddings=True, **extra)
    save_random_checkpoint(config, str(tmp_path), seed=3)
    read = ModelConfig.from_pretrained(str(tmp_path))
    assert read == config, {k: (v, getattr(config, k)) for k, v in read if v != getattr(config, k)}
    hf = getattr(transformers, arch).from_pretrained(str(tmp_path), attn_implementation="eager",
                                                     dtype=torch.float32).eval()
    model = build_model(config, block_size=BLOCK_SIZE, kernel="torch")
    model.init_random_weights(3)
    tokens = random_tokens(config.vocab_size)
    got = run_schedule(model, tokens, SCHEDULE)
    assert_close(got, hf_logits(hf, tokens))


# -- loading at every TP slice ------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["MptForCausalLM", "Gemma2ForCausalLM"])
def test_checkpoint_round_trip_at_every_tp_slice(arch, tmp_path):
    config = ModelConfig(architecture=arch, vocab_size=64, hidden_size=128, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=64)
    save_random_checkpoint(config, str(tmp_path), seed=5, num_shards=2)
    for tp in (1, 2, 4):
        for rank in range(tp):
            kw = dict(tp_rank=rank, tp_size=tp, tp_group=NO_COLLECTIVES if tp > 1 else None)
            loaded, fresh = build_model(config, **kw), build_model(config, **kw)
            loaded.load_weights(str(tmp_path))
            fresh.init_random_weights(5)
            for (name, a), (_, b) in zip(loaded.named_parameters(), fresh.named_parameters()):
                assert torch.equal(a, b), f"tp={tp} rank={rank} {name}"


def test_mpt_wqkv_is_cut_by_heads(tmp_path):
    """Each rank holds its own query heads' rows of q, k and v from the one fused tensor."""
    from safetensors.torch import load_file

    config = ModelConfig(architecture="MptForCausalLM", vocab_size=64, hidden_size=128,
                         num_hidden_layers=1, num_attention_heads=4)
    save_random_checkpoint(config, str(tmp_path), seed=0)
    full = load_file(str(tmp_path / "model.safetensors"))["transformer.blocks.0.attn.Wqkv.weight"]
    q, k, v = full.chunk(3)
    for rank in range(2):
        m = build_model(config, tp_rank=rank, tp_size=2, tp_group=NO_COLLECTIVES)
        m.load_weights(str(tmp_path))
        rows = slice(rank * 64, (rank + 1) * 64)  # 2 heads of 32 per rank
        assert torch.equal(m.layers[0].self_attn.qkv_proj.weight, torch.cat([q[rows], k[rows], v[rows]]))


# -- ALiBi slopes ------------------------------------------------------------------------------------
@pytest.mark.parametrize("bias_max", [8, 16, 4])
@pytest.mark.parametrize("heads", [1, 4, 6, 12, 16, 48])
def test_alibi_slopes_are_mpts(heads, bias_max):
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    # HF's bias at the key one before the last is -slope.
    want = -build_mpt_alibi_tensor(heads, 4, bias_max)[:, 0, -2]
    got = torch.tensor(alibi_slopes(heads, bias_max), dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=2e-7, atol=0)


# -- configs -----------------------------------------------------------------------------------------
def test_every_architecture_has_a_model_a_reader_and_a_writer():
    assert set(MODELS) == set(READERS) == set(WRITERS) == set(ARCHITECTURES) == set(get_args(Architecture))
    assert type(build_model(ModelConfig(architecture="MistralForCausalLM"))) is LlamaForCausalLM
    with pytest.raises(ValueError, match="architecture='MptForCausalLM' is not served by LlamaForCausalLM"):
        LlamaForCausalLM(ModelConfig(architecture="MptForCausalLM"))


def test_hf_configs_map_onto_ours(tmp_path):
    mpt_config(alibi_bias_max=16, clip_qkv=3.0).save_pretrained(tmp_path / "mpt")
    got = ModelConfig.from_pretrained(str(tmp_path / "mpt"))
    assert (got.architecture, got.hidden_size, got.num_attention_heads, got.num_key_value_heads,
            got.num_hidden_layers, got.intermediate_size, got.max_position_embeddings) == \
           ("MptForCausalLM", 128, 4, 4, 3, 512, 128)
    assert (got.use_alibi, got.alibi_bias_max, got.clip_qkv, got.softmax_scale) == (True, 16.0, 3.0, None)
    assert got.attention_scale == 32 ** -0.5
    gemma2_config(sliding_window=16, query_pre_attn_scalar=256).save_pretrained(tmp_path / "gemma2")
    got = ModelConfig.from_pretrained(str(tmp_path / "gemma2"))
    assert (got.architecture, got.head_size, got.sliding_window, got.rope_theta, got.rms_norm_eps) == \
           ("Gemma2ForCausalLM", 32, 16, 5000.0, 1e-6)
    assert got.tie_word_embeddings and got.attention_scale == 256 ** -0.5


@pytest.mark.parametrize("config, message", [
    ({"architectures": ["GPT2LMHeadModel"]}, r"GPT2LMHeadModel.*not supported.*MptForCausalLM.*Gemma2ForCausalLM"),
    ({"model_type": "gpt2"}, r"model_type='gpt2' is not supported.*mpt.*gemma2"),
    ({"model_type": "mpt", "d_model": 64, "n_heads": 2, "n_layers": 1, "vocab_size": 8,
      "attn_config": {"qk_ln": True}}, r"attn_config\.qk_ln=True is not supported"),
    ({"model_type": "mpt", "d_model": 64, "n_heads": 2, "n_layers": 1, "vocab_size": 8,
      "attn_config": {"attn_type": "multiquery_attention"}}, r"attn_config\.attn_type='multiquery_attention'"),
    ({"model_type": "mpt", "d_model": 64, "n_heads": 2, "n_layers": 1, "vocab_size": 8,
      "attn_config": {"alibi": False}}, r"attn_config\.alibi=False"),
    ({"model_type": "mpt", "d_model": 64, "n_heads": 2, "n_layers": 1, "vocab_size": 8, "no_bias": False},
     r"no_bias=False"),
    ({"model_type": "mpt", "n_heads": 2, "n_layers": 1, "vocab_size": 8}, r"lacks d_model"),
    ({"model_type": "gemma2", "hidden_activation": "gelu"}, r"hidden_activation='gelu' is not supported"),
    ({"model_type": "gemma2", "num_hidden_layers": 2, "sliding_window": None},
     r"sliding_window=None is not supported \(its sliding_attention layers need a window\)"),
])
def test_unsupported_configs_are_refused_by_name(config, message, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_pretrained(str(tmp_path))


def test_family_fixed_fields():
    mpt = ModelConfig(architecture="MptForCausalLM", num_attention_heads=8, hidden_size=512)
    # the family's values when unset
    assert mpt.use_alibi and mpt.num_key_value_heads == 8 and mpt.intermediate_size == 2048
    assert ModelConfig.model_validate(mpt.model_dump()) == mpt
    with pytest.raises(ValueError, match=r"needs use_alibi=True, got False \(MPT's only position signal"):
        ModelConfig(architecture="MptForCausalLM", use_alibi=False)
    with pytest.raises(ValueError, match=r"needs num_key_value_heads=4, got 2"):
        ModelConfig(architecture="MptForCausalLM", num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"needs intermediate_size=1024, got 512 \(HF transformers' MPT MLP"):
        ModelConfig(architecture="MptForCausalLM", intermediate_size=512)
    with pytest.raises(ValueError, match=r"needs use_alibi=False"):
        ModelConfig(architecture="Gemma2ForCausalLM", use_alibi=True)
    with pytest.raises(ValueError, match="softmax_scale=0.1 and query_pre_attn_scalar=16.0 both set"):
        ModelConfig(softmax_scale=0.1, query_pre_attn_scalar=16)
    with pytest.raises(ValueError, match="architecture"):
        ModelConfig(architecture="GPT2LMHeadModel")
    # A family's config.json has no place for another family's settings.
    with pytest.raises(ValueError, match=r"MptForCausalLM config.json cannot hold logits_soft_cap=3.0"):
        save_random_checkpoint(ModelConfig(architecture="MptForCausalLM", logits_soft_cap=3.0), "/nonexistent", 0)
