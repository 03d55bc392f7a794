"""MPT (ALiBi), Gemma-2 (soft caps, sliding + full layers), Qwen2 (q/k/v biases, sliding layers
from max_window_layers) and Qwen3 (per-head q/k RMSNorm, explicit head_dim) against HF transformers.

Parity runs on checkpoints transformers itself wrote (``save_pretrained``), read through
``ModelConfig.from_pretrained`` and the registry, over the chunked-prefill + decode schedule.
Tolerance atol 1e-4 in float32, as in test_hf_parity.py: both sides compute the same math with
different summation orders (fused projections, paged softmax), ~1e-6 apart on logits of order 1,
while a wrong bias, mask, cap or norm moves them by 1e-2 or more.  HF's own 0.02 init would make
attention near-uniform, so ``reinit`` draws 1/sqrt(fan_in) matrices (peaked attention, logits of
order 1) and every 1-D weight near but not at 1 (Qwen2's q/k/v biases too: ~1, as large as the
projections themselves, so a bias dropped or cut from the wrong rows moves logits by far more than
the tolerance).
"""

from __future__ import annotations

import json
from typing import get_args

import pytest
import torch

from ray_attn.config import ARCHITECTURES, Architecture, ModelConfig
from ray_attn.hf_config import READERS
from ray_attn.hf_export import WRITERS
from ray_attn.model import (MODELS, Gemma2ForCausalLM, LlamaForCausalLM, MptForCausalLM, Qwen2ForCausalLM,
                            Qwen3ForCausalLM, build_model, save_random_checkpoint)
from ray_attn.model.layers import alibi_slopes
from tests.model.steps import BLOCK_SIZE, SCHEDULE, random_tokens, run_schedule
from tests.model.test_hf_parity import assert_close, hf_logits

transformers = pytest.importorskip("transformers")
NO_COLLECTIVES = object()  # tp_size > 1 without collectives: loading never all-reduces


def reinit(hf, seed: int, norm_offset: bool = False) -> None:
    """Seeded weights with non-trivial scales; ``norm_offset``: the norms scale by 1 + weight.
    Llama 4 stores its fused experts input-major ([E, in, out]): their fan_in is dim -2."""
    g = torch.Generator().manual_seed(seed)
    input_major = "llama4" in hf.config.model_type
    with torch.no_grad():
        for _, p in hf.named_parameters():  # tied weights appear once
            t = torch.randn(p.shape, generator=g)
            if p.dim() == 1:
                p.copy_(t * 0.05 + (0.0 if norm_offset else 1.0))
            else:
                p.copy_(t * p.shape[-2 if input_major and p.dim() == 3 else -1] ** -0.5)


def hf_checkpoint(hf_cls, hf_config, folder, seed=1, norm_offset=False):
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


def qwen_config(family: str, **kw):
    base = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    return (transformers.Qwen2Config if family == "qwen2" else transformers.Qwen3Config)(**(base | kw))


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


QWEN_CASES = {
    # HF's own sliding pattern: full layers below max_window_layers, sliding from there on (the
    # test drops layer_types from config.json, as older checkpoints have none: both sides derive it).
    "qwen2_sliding_from_layer_1": ("qwen2", dict(use_sliding_window=True, max_window_layers=1, sliding_window=8),
                                   ["full_attention", "sliding_attention", "sliding_attention"]),
    # A window with use_sliding_window false is no window (as in released Qwen2.5 configs);
    # one KV head, tied embeddings.
    "qwen2_window_off_mqa_tied": ("qwen2", dict(sliding_window=8, num_key_value_heads=1, tie_word_embeddings=True),
                                  ["full_attention"] * 3),
    # head_dim 64 with hidden 128 / 4 heads: q is wider than the residual stream.
    "qwen3_head_dim_64": ("qwen3", dict(head_dim=64), ["full_attention"] * 3),
    # An explicit layer_types list wins over max_window_layers.
    "qwen3_layer_types": ("qwen3", dict(head_dim=32, use_sliding_window=True, sliding_window=8, max_window_layers=0,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
                          ["sliding_attention", "full_attention", "sliding_attention"]),
}


@pytest.mark.parametrize("case", QWEN_CASES)
def test_qwen_matches_hf(case, tmp_path):
    family, kw, kinds = QWEN_CASES[case]
    hf_cls = transformers.Qwen2ForCausalLM if family == "qwen2" else transformers.Qwen3ForCausalLM
    hf = hf_checkpoint(hf_cls, qwen_config(family, **kw), tmp_path, seed=6)
    if "layer_types" not in kw:
        path = tmp_path / "config.json"
        path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "layer_types"}))
        hf = hf_cls.from_pretrained(str(tmp_path), attn_implementation="eager", dtype=torch.float32).eval()
        assert hf.config.layer_types == kinds
    model, tokens, got = ours(tmp_path)
    cfg = model.config
    assert isinstance(model, Qwen2ForCausalLM if family == "qwen2" else Qwen3ForCausalLM)
    assert cfg.layer_kinds() == kinds
    assert cfg.head_size == kw.get("head_dim", 32) and cfg.rms_norm_eps == 1e-6 and cfg.rope_theta == 5000.0
    if "sliding_attention" in kinds:
        assert max(len(t) for t in tokens) > 4 * cfg.sliding_window  # the window clips
    assert_close(got, hf_logits(hf, tokens))


@pytest.mark.parametrize("arch", ["MptForCausalLM", "Gemma2ForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_our_random_checkpoints_load_in_hf(arch, tmp_path):
    """save_random_checkpoint writes each family's config.json and names, scaled so the model is
    alive; init_random_weights is the same model."""
    extra = dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"], head_dim=32,
                 logits_soft_cap=4.0, final_logit_soft_cap=5.0, query_pre_attn_scalar=16.0,
                 num_key_value_heads=2, intermediate_size=256) if arch == "Gemma2ForCausalLM" else \
        dict(clip_qkv=2.0) if arch == "MptForCausalLM" else \
        dict(num_key_value_heads=1, head_dim=64, intermediate_size=256, rms_norm_eps=1e-6, sliding_window=8,
             layer_types=["full_attention", "sliding_attention"], eos_token_ids=[3, 7])
    config = ModelConfig(architecture=arch, vocab_size=128, hidden_size=128, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=256, tie_word_embeddings=True, **extra)
    assert_random_checkpoint_loads_in_hf(config, tmp_path, random_tokens(config.vocab_size), SCHEDULE)


def assert_random_checkpoint_loads_in_hf(config, folder, tokens, schedule, chunk=None):
    """Our seeded random checkpoint reads back as ``config`` and HF, loading it, gives our logits."""
    save_random_checkpoint(config, str(folder), seed=3)
    read = ModelConfig.from_pretrained(str(folder))
    assert read == config, {k: (v, getattr(config, k)) for k, v in read if v != getattr(config, k)}
    hf = getattr(transformers, config.architecture).from_pretrained(
        str(folder), attn_implementation="eager", dtype=torch.float32).eval()
    model = build_model(config, block_size=BLOCK_SIZE, kernel="torch")
    model.init_random_weights(3)
    assert_close(run_schedule(model, tokens, schedule, chunk=chunk), hf_logits(hf, tokens))


def round_trip_slices(config, folder):
    """A sharded random checkpoint loaded at every rank of TP 1, 2 and 4, each rank's parameters
    equal to what init_random_weights gives it; yields (tp, rank, loaded model)."""
    save_random_checkpoint(config, str(folder), seed=5, num_shards=2)
    for tp in (1, 2, 4):
        for rank in range(tp):
            kw = dict(tp_rank=rank, tp_size=tp, tp_group=NO_COLLECTIVES if tp > 1 else None)
            loaded, fresh = build_model(config, **kw), build_model(config, **kw)
            loaded.load_weights(str(folder))
            fresh.init_random_weights(5)
            for (name, a), (_, b) in zip(loaded.named_parameters(), fresh.named_parameters()):
                assert torch.equal(a, b), f"tp={tp} rank={rank} {name}"
            yield tp, rank, loaded


# -- loading at every TP slice ------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["MptForCausalLM", "Gemma2ForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_checkpoint_round_trip_at_every_tp_slice(arch, tmp_path):
    config = ModelConfig(architecture=arch, vocab_size=64, hidden_size=128, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=64)
    for _ in round_trip_slices(config, tmp_path):
        pass


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


@pytest.mark.parametrize("tp, kv_heads", [(2, 4), (2, 1), (4, 2)])
def test_qwen2_biases_follow_their_heads(tp, kv_heads, tmp_path):
    """Each rank's q/k/v bias pieces are the rows of the heads it holds: its own query heads, and
    its KV heads split (kv_heads >= tp) or replicated (kv_heads < tp)."""
    from safetensors.torch import load_file

    config = ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=64, hidden_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=32)
    save_random_checkpoint(config, str(tmp_path), seed=0)
    full = load_file(str(tmp_path / "model.safetensors"))
    q, k, v = (full[f"model.layers.0.self_attn.{n}_proj.bias"] for n in "qkv")
    for rank in range(tp):
        m = build_model(config, tp_rank=rank, tp_size=tp, tp_group=NO_COLLECTIVES)
        m.load_weights(str(tmp_path))
        kv_head = rank * kv_heads // tp  # first KV head of this rank
        kv_rows = slice(kv_head * 32, (kv_head + max(1, kv_heads // tp)) * 32)
        q_rows = slice(rank * 128 // tp, (rank + 1) * 128 // tp)
        assert torch.equal(m.layers[0].self_attn.qkv_proj.bias, torch.cat([q[q_rows], k[kv_rows], v[kv_rows]]))


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
    # As released: a window and max_window_layers < layers, but use_sliding_window false -- no window.
    (tmp_path / "qwen2").mkdir()
    (tmp_path / "qwen2" / "config.json").write_text(json.dumps(QWEN25_05B_CONFIG))
    got = ModelConfig.from_pretrained(str(tmp_path / "qwen2"))
    assert (got.architecture, got.sliding_window, got.layer_types, got.head_size, got.num_key_value_heads,
            got.rope_theta, got.tie_word_embeddings, got.dtype, got.eos_token_ids) == \
           ("Qwen2ForCausalLM", None, None, 64, 2, 1e6, True, "bfloat16", [151645])
    # Keys a config.json leaves out take transformers' Qwen defaults, not ours.
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 1024,
                                                                "num_attention_heads": 16, "num_key_value_heads": 8}))
    got = ModelConfig.from_pretrained(str(tmp_path / "bare"))
    assert (got.architecture, got.head_size, got.rms_norm_eps, got.vocab_size, got.max_position_embeddings) == \
           ("Qwen3ForCausalLM", 128, 1e-6, 151936, 32768)


# Qwen/Qwen2.5-0.5B-Instruct's config.json (transformers 4.43 era: no layer_types).
QWEN25_05B_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
    "max_position_embeddings": 32768, "max_window_layers": 21, "model_type": "qwen2", "num_attention_heads": 14,
    "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.43.1",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}


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
    ({"model_type": "qwen2", "hidden_act": "gelu"}, r"Qwen2ForCausalLM config.json: hidden_act='gelu' is not supported"),
    ({"model_type": "qwen3", "attention_bias": True}, r"Qwen3ForCausalLM config.json: attention_bias=True"),
    # transformers drops the window when use_sliding_window is false: sliding layers would have none.
    ({"model_type": "qwen2", "num_hidden_layers": 2, "sliding_window": 8, "use_sliding_window": False,
      "layer_types": ["sliding_attention", "full_attention"]},
     r"sliding_window=None is not supported .*use_sliding_window=False"),
    ({"model_type": "qwen2", "num_hidden_layers": 2, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     r"rope_scaling rope_type='yarn' is not supported; supported: default, llama3"),
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
