"""ModelConfig.from_pretrained reads an HF config.json: ours round-trips, HF's own loads."""

import json

import pytest

from ray_attn.config import ModelConfig
from ray_attn.model.weights import hf_config_dict


def test_round_trip_of_our_own_config(tmp_path):
    cfg = ModelConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, rope_theta=5e5, rms_norm_eps=1e-6,
                      tie_word_embeddings=True, dtype="bfloat16")
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(cfg)))
    got = ModelConfig.from_pretrained(str(tmp_path), seed=cfg.seed)
    assert got.model_dump() == cfg.model_dump()


def test_hf_llama_and_mistral_configs(tmp_path):
    transformers = pytest.importorskip("transformers")
    llama = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     rope_theta=500000.0, max_position_embeddings=4096,
                                     rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 8192})
    llama.save_pretrained(tmp_path / "llama")
    got = ModelConfig.from_pretrained(str(tmp_path / "llama"))
    assert (got.hidden_size, got.num_key_value_heads, got.head_size, got.rope_theta) == (256, 2, 64, 500000.0)
    assert got.rope_scaling["rope_type"] == "llama3" and got.rope_scaling["factor"] == 8.0
    mistral = transformers.MistralConfig(vocab_size=1000, hidden_size=256, intermediate_size=512,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, sliding_window=64)
    mistral.save_pretrained(tmp_path / "mistral")
    got = ModelConfig.from_pretrained(str(tmp_path / "mistral"))
    assert got.sliding_window == 64 and set(got.layer_kinds()) == {"sliding_attention"}


def test_rejects_other_architectures(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "hidden_size": 64}))
    with pytest.raises(ValueError, match="BertModel"):
        ModelConfig.from_pretrained(str(tmp_path))
