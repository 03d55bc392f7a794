"""Mixtral, Qwen3-MoE and Llama 4 (text, and the text part of the multimodal checkpoint) against HF
transformers, on checkpoints transformers wrote (``save_pretrained``), over chunked prefill + decode.

Tolerance atol 1e-4 in float32, as in test_hf_parity.py (observed ~1e-6: summation order only).
``reinit`` draws 1/sqrt(fan_in) matrices, the router included, so routing depends on the token
(router logits of order 1: the top-k changes from token to token, checked below) and a routing
bug -- a softmax where a sigmoid belongs, a dropped renormalisation, the weight on the output
instead of the input -- moves logits by far more than the tolerance.  Llama 4 runs with
chunk 32 over block 16 and sequences of up to 100 tokens (three chunk boundaries), with
temperature tuning at a floor_scale small enough that its scale changes within them.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from ray_attn.config import ModelConfig
from ray_attn.model import build_model
from ray_attn.model.moe import SparseMoeBlock
from tests.model.steps import BLOCK_SIZE, run_schedule
from tests.model.test_families import (assert_random_checkpoint_loads_in_hf, hf_checkpoint as hf_model,
                                       round_trip_slices)
from tests.model.test_hf_parity import assert_close, hf_logits

transformers = pytest.importorskip("transformers")

# Two sequences of 100 and 78 tokens: chunked prefill over chunk boundaries, then decode.
SCHEDULE = [[40, 60], [40, 15], [17, 0], [1, 1], [1, 1], [1, 1]]
LENGTHS = [100, 78]
COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def tokens(vocab: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).numpy() for n in LENGTHS]


def ours(folder, **kw):
    config = ModelConfig.from_pretrained(str(folder), dtype="float32")
    model = build_model(config, block_size=BLOCK_SIZE, kernel="torch", **kw)
    model.load_weights(str(folder))
    toks = tokens(config.vocab_size)
    return model, toks, run_schedule(model, toks, SCHEDULE, chunk=config.attention_chunk_size)


def routing_varies(model, toks) -> None:
    """The check means something: the first sparse layer routes different tokens differently."""
    block = next(m for m in model.modules() if isinstance(m, SparseMoeBlock))
    x = torch.randn(64, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    _, ids = block.route(x)
    assert len({tuple(r) for r in ids.tolist()}) > 2


def llama4_config(**kw):
    base = dict(COMMON, intermediate_size=64, intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=1,
                interleave_moe_layer_step=2, attention_chunk_size=32, no_rope_layers=[1, 1, 1, 0], use_qk_norm=True,
                attn_temperature_tuning=True, floor_scale=16, attn_scale=0.5,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return transformers.Llama4TextConfig(**(base | kw))


LLAMA4_CASES = {
    # Scout's pattern: NoPE every 4th layer, top-1 sigmoid routing, qk norm, temperature tuning; MoE on odd layers
    "scout_like": dict(),
    # top-2, every layer sparse, NoPE on alternate layers, no qk norm; llama3 RoPE scaling
    "top2_dense_free": dict(num_experts_per_tok=2, interleave_moe_layer_step=1, no_rope_layers=[1, 0, 1, 0],
                            use_qk_norm=False, rope_parameters={
                                "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
}


@pytest.mark.parametrize("case", LLAMA4_CASES)
def test_llama4_matches_hf(case, tmp_path):
    hf = hf_model(transformers.Llama4ForCausalLM, llama4_config(**LLAMA4_CASES[case]), tmp_path)
    model, toks, got = ours(tmp_path)
    cfg = model.config
    assert cfg.layer_kinds().count("chunked_attention") == 3 - (case != "scout_like")
    assert max(LENGTHS) > 3 * cfg.attention_chunk_size  # three chunk boundaries
    routing_varies(model, toks)
    assert_close(got, hf_logits(hf, toks))


def test_llama4_text_part_of_the_multimodal_checkpoint(tmp_path):
    """A Llama4ForConditionalGeneration as transformers writes it: ``text_config`` and the text model
    under ``language_model.``, next to a vision tower the text model does not read."""
    text = llama4_config()
    vision = transformers.Llama4VisionConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=64, image_size=28, patch_size=14, vision_output_dim=32,
                                             projector_input_dim=32, projector_output_dim=32)
    cfg = transformers.Llama4Config(text_config=text.to_dict(), vision_config=vision.to_dict())
    hf = hf_model(transformers.Llama4ForConditionalGeneration, cfg, tmp_path)
    names = json.loads((tmp_path / "config.json").read_text())
    assert names["architectures"] == ["Llama4ForConditionalGeneration"] and "text_config" in names
    model, toks, got = ours(tmp_path)
    assert model.config.architecture == "Llama4ForCausalLM"
    assert_close(got, hf_logits(hf.language_model, toks))


MIXTRAL_CASES = {
    "top2_of_4": dict(num_local_experts=4, num_experts_per_tok=2),
    "top3_of_8_sliding": dict(num_local_experts=8, num_experts_per_tok=3, sliding_window=24),
}


@pytest.mark.parametrize("case", MIXTRAL_CASES)
def test_mixtral_matches_hf(case, tmp_path):
    cfg = transformers.MixtralConfig(**COMMON, intermediate_size=96, **MIXTRAL_CASES[case],
                                     rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    hf = hf_model(transformers.MixtralForCausalLM, cfg, tmp_path)
    model, toks, got = ours(tmp_path)
    routing_varies(model, toks)
    assert_close(got, hf_logits(hf, toks))


QWEN3_MOE_CASES = {
    "norm_topk": dict(norm_topk_prob=True),
    "no_norm_sparse_step_2": dict(norm_topk_prob=False, decoder_sparse_step=2),
    "mlp_only_layers": dict(norm_topk_prob=False, mlp_only_layers=[0, 2]),
}


@pytest.mark.parametrize("case", QWEN3_MOE_CASES)
def test_qwen3_moe_matches_hf(case, tmp_path):
    cfg = transformers.Qwen3MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=48, num_experts=8,
                                      num_experts_per_tok=2, **QWEN3_MOE_CASES[case],
                                      rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    hf = hf_model(transformers.Qwen3MoeForCausalLM, cfg, tmp_path)
    model, toks, got = ours(tmp_path)
    sparse = {"norm_topk": (0, 1, 2, 3), "no_norm_sparse_step_2": (1, 3), "mlp_only_layers": (1, 3)}[case]
    assert model.config.moe_layer_ids == sparse
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers] == [i in sparse for i in range(4)]
    routing_varies(model, toks)
    assert_close(got, hf_logits(hf, toks))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_fused_expert_tensors_load(family, tmp_path):
    """Checkpoints in transformers 5's in-memory form (``mlp.experts.gate_up_proj`` [E, 2I, H],
    ``down_proj`` [E, H, I]), as its state_dict() holds them, load as the per-expert ones do."""
    kw = dict(COMMON, intermediate_size=96, num_experts_per_tok=2, rope_parameters={"rope_type": "default",
                                                                                    "rope_theta": 1e6})
    cfg = transformers.MixtralConfig(**kw, num_local_experts=4) if family == "mixtral" else \
        transformers.Qwen3MoeConfig(**kw, moe_intermediate_size=48, num_experts=4, norm_topk_prob=True)
    hf = hf_model(getattr(transformers, cfg.architectures[0] if cfg.architectures else
                          {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[family]), cfg, tmp_path)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    (tmp_path / "model.safetensors").unlink()
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    _, toks, got = ours(tmp_path)
    assert_close(got, hf_logits(hf, toks))


# -- our own random checkpoints --------------------------------------------------------------------------
MOE_CONFIGS = {
    "MixtralForCausalLM": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=128),
    "Qwen3MoeForCausalLM": dict(num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                intermediate_size=128, moe_layers=[1], norm_topk_prob=True, head_dim=64),
    "Llama4ForCausalLM": dict(num_local_experts=4, num_experts_per_tok=1, moe_intermediate_size=64,
                              intermediate_size=128, moe_layers=[1], no_rope_layers=[1, 0], use_qk_norm=True,
                              attn_temperature_tuning=True, floor_scale=16.0, attention_chunk_size=32,
                              layer_types=["chunked_attention", "full_attention"]),
}


def moe_config(arch, **kw):
    return ModelConfig(architecture=arch, vocab_size=128, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=256, **({"head_dim": 32} | MOE_CONFIGS[arch] | kw))


@pytest.mark.parametrize("arch", list(MOE_CONFIGS))
def test_our_random_moe_checkpoints_load_in_hf(arch, tmp_path):
    config = moe_config(arch)
    assert_random_checkpoint_loads_in_hf(config, tmp_path, tokens(config.vocab_size), SCHEDULE,
                                         chunk=config.attention_chunk_size)


@pytest.mark.parametrize("arch", list(MOE_CONFIGS))
def test_expert_slices_at_every_tp_size(arch, tmp_path):
    """Each rank loads its slice of every expert's width (and of the shared expert's) from the
    checkpoint, the same numbers init_random_weights gives it."""
    config = moe_config(arch)
    for tp, _, loaded in round_trip_slices(config, tmp_path):
        w13 = next(m for m in loaded.modules() if isinstance(m, SparseMoeBlock)).experts.w13
        assert w13.shape[1] == 2 * 64 // tp if arch != "MixtralForCausalLM" else 2 * 128 // tp
