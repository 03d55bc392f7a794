"""The sparse families' config fields: real checkpoints' config.json mapped onto ModelConfig, and
every config no model of ours computes refused with the field's name."""

from __future__ import annotations

import json

import pytest

from ray_attn.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig

# Qwen/Qwen3-30B-A3B's config.json (transformers 4.51 era).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936}
# meta-llama/Llama-4-Scout-17B-16E-Instruct's config.json, its text_config (vision_config left out).
SCOUT_TEXT = {
    "attention_bias": False, "attention_chunk_size": 8192, "attention_dropout": 0.0, "attn_scale": 0.1,
    "attn_temperature_tuning": 4, "bos_token_id": 200000, "eos_token_id": [200001, 200007, 200008],
    "floor_scale": 8192, "for_llm_compressor": False, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
    "interleave_moe_layer_step": 1, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
    "max_position_embeddings": 10485760, "model_type": "llama4_text", "moe_layers": list(range(48)),
    "no_rope_layers": [], "num_attention_heads": 40, "num_experts_per_tok": 1, "num_hidden_layers": 48,
    "num_key_value_heads": 8, "num_local_experts": 16, "output_router_logits": False, "pad_token_id": 200018,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0, "torch_dtype": "bfloat16",
    "use_cache": True, "use_qk_norm": True, "vocab_size": 202048}
SCOUT = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "text_config": SCOUT_TEXT,
         "torch_dtype": "bfloat16", "tie_word_embeddings": False}


def read(tmp_path, cfg) -> ModelConfig:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return ModelConfig.from_pretrained(str(tmp_path))


def test_qwen3_30b_a3b(tmp_path):
    got = read(tmp_path, QWEN3_30B_A3B)
    assert got == ModelConfig.from_name("qwen3-30b-a3b", max_position_embeddings=40960, eos_token_ids=[151645])
    assert (got.moe_layer_ids, got.expert_intermediate_size, got.shared_expert_intermediate_size) == \
           (tuple(range(48)), 768, None)


def test_llama4_scout_text_part(tmp_path):
    got = read(tmp_path, SCOUT)
    assert got.architecture == "Llama4ForCausalLM" and got.eos_token_ids == [200001, 200007, 200008]
    # HF's defaults for the empty no_rope_layers: NoPE (full attention) on every 4th layer
    assert got.no_rope_layers == [1, 1, 1, 0] * 12
    assert got.layer_kinds() == (["chunked_attention"] * 3 + ["full_attention"]) * 12
    assert (got.intermediate_size, got.expert_intermediate_size, got.shared_expert_intermediate_size) == \
           (16384, 8192, 8192)
    assert got.attn_temperature_tuning and got.use_qk_norm and got.rope_scaling["rope_type"] == "llama3"
    assert got == ModelConfig.from_name("llama-4-scout", max_position_embeddings=10485760,
                                        eos_token_ids=[200001, 200007, 200008])


def test_llama4_interleave_step_and_defaults(tmp_path):
    got = read(tmp_path, dict(SCOUT_TEXT, model_type="llama4_text", moe_layers=None, interleave_moe_layer_step=2,
                              num_hidden_layers=4, no_rope_layers=None, attention_chunk_size=None,
                              layer_types=None))
    assert got.moe_layer_ids == (1, 3) and got.layer_kinds() == ["full_attention"] * 4
    assert got.no_rope_layers == [1, 1, 1, 0]


@pytest.mark.parametrize("cfg, message", [
    ({"model_type": "mixtral", "hidden_act": "gelu"}, r"MixtralForCausalLM config.json: hidden_act='gelu'"),
    (dict(QWEN3_30B_A3B, num_experts=0), r"Qwen3MoeForCausalLM config.json: num_experts=0 is not supported"),
    (dict(QWEN3_30B_A3B, decoder_sparse_step=0), r"decoder_sparse_step=0"),
    (dict(SCOUT_TEXT, attention_bias=True), r"Llama4ForCausalLM config.json: attention_bias=True"),
    (dict(SCOUT_TEXT, num_hidden_layers=2, moe_layers=[1], layer_types=["sliding_attention", "full_attention"]),
     r"layer_types=.*Llama 4 has chunked and full attention layers only"),
    ({"architectures": ["Llama4ForConditionalGeneration"]}, r"lacks its text_config"),
])
def test_unsupported_moe_configs_are_refused_by_name(cfg, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        read(tmp_path, cfg)


MOE = dict(architecture="Qwen3MoeForCausalLM", num_local_experts=8, moe_intermediate_size=64)


@pytest.mark.parametrize("fields, message", [
    (dict(num_local_experts=4), r"num_local_experts=4: architecture=LlamaForCausalLM has no experts"),
    (dict(architecture="Qwen3ForCausalLM", use_qk_norm=True), r"use_qk_norm=True is a Llama 4 option"),
    (dict(architecture="MixtralForCausalLM"), r"architecture=MixtralForCausalLM needs num_local_experts"),
    (dict(MOE, num_experts_per_tok=9), r"num_experts_per_tok=9 must not exceed num_local_experts=8"),
    (dict(MOE, moe_layers=[0, 9]), r"moe_layers=\[0, 9\] must be increasing layer indices in \[0, num_hidden_layers=4\)"),
    (dict(MOE, architecture="Llama4ForCausalLM", no_rope_layers=[1, 0]), r"no_rope_layers=\[1, 0\] needs a 0"),
    (dict(architecture="MixtralForCausalLM", num_local_experts=4, norm_topk_prob=False),
     r"needs norm_topk_prob=True, got False \(Mixtral renormalises"),
    (dict(MOE, shared_expert_intermediate_size=32), r"needs shared_expert_intermediate_size=None"),
    (dict(MOE, architecture="Llama4ForCausalLM", shared_expert_intermediate_size=32),
     r"needs shared_expert_intermediate_size=64"),
])
def test_model_config_refuses_what_no_family_computes(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**fields)


def test_tp_must_divide_every_expert_width():
    par = ParallelConfig(tensor_parallel_size=4, device="cpu")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 must divide moe_intermediate_size .*=66"):
        EngineConfig(model=ModelConfig(**(MOE | dict(moe_intermediate_size=66))), parallel=par)
    # every layer sparse: the dense width is not used, so not checked
    EngineConfig(model=ModelConfig(**(MOE | dict(intermediate_size=6))), parallel=par, cache=CacheConfig(num_blocks=8))
    with pytest.raises(ValueError, match=r"must divide intermediate_size=6"):
        EngineConfig(model=ModelConfig(**(MOE | dict(intermediate_size=6, moe_layers=[1]))), parallel=par)
