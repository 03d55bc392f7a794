"""A checkpoint folder configures its model: ``EngineConfig(checkpoint=folder)`` takes the shapes of
its config.json, a mapping ``model`` overrides fields on top, a model that disagrees is refused on
the driver naming each field; and ``eos_token_ids`` come from generation_config.json or config.json.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import yaml

from ray_attn.config import EngineConfig, ModelConfig
from ray_attn.hf_export import hf_config_dict
from ray_attn.model import build_model, save_random_checkpoint

transformers = pytest.importorskip("transformers")
SHAPE = dict(architecture="Qwen2ForCausalLM", vocab_size=96, hidden_size=64, intermediate_size=128,
             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)


@pytest.fixture
def folder(tmp_path):
    """Our own random Qwen2 checkpoint (config.json + safetensors), shapes unlike ModelConfig's defaults."""
    save_random_checkpoint(ModelConfig(**SHAPE), str(tmp_path), seed=3)
    return str(tmp_path)


def write(folder, name: str, data: dict) -> None:
    with open(f"{folder}/{name}", "w") as f:
        json.dump(data, f)


# -- eos_token_ids -------------------------------------------------------------------------------------
@pytest.mark.parametrize("config_eos, generation, want", [
    (5, None, [5]),
    ([1, 2], None, [1, 2]),
    (None, None, []),
    ("absent", None, []),
    # generation_config.json's eos_token_id wins, whatever it is (null included) ...
    (5, {"eos_token_id": [7, 8]}, [7, 8]),
    (5, {"eos_token_id": 9}, [9]),
    (5, {"eos_token_id": None}, []),
    # ... but only where it sets one.
    (5, {"temperature": 0.7}, [5]),
])
def test_eos_token_ids_from_the_checkpoint(config_eos, generation, want, folder):
    cfg = json.load(open(f"{folder}/config.json"))
    cfg.pop("eos_token_id", None)
    if config_eos != "absent":
        cfg["eos_token_id"] = config_eos
    write(folder, "config.json", cfg)
    if generation is not None:
        write(folder, "generation_config.json", generation)
    assert ModelConfig.from_pretrained(folder).eos_token_ids == want
    assert EngineConfig(checkpoint=folder).model.eos_token_ids == want
    # an override wins over both files
    assert ModelConfig.from_pretrained(folder, eos_token_ids=[4]).eos_token_ids == [4]


def test_eos_token_ids_of_a_transformers_checkpoint(tmp_path):
    """Qwen2.5-Instruct's layout: one id in config.json, the chat end and the text end in
    generation_config.json (which save_pretrained writes from the model's config)."""
    hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, eos_token_id=[60, 61]))
    hf.save_pretrained(str(tmp_path))
    assert ModelConfig.from_pretrained(str(tmp_path)).eos_token_ids == [60, 61]
    cfg = json.load(open(tmp_path / "config.json"))
    write(tmp_path, "config.json", cfg | {"eos_token_id": 61})
    write(tmp_path, "generation_config.json", {"eos_token_id": [61, 60], "top_k": 20})
    assert ModelConfig.from_pretrained(str(tmp_path)).eos_token_ids == [61, 60]


@pytest.mark.parametrize("name, bad", [("config.json", "2"), ("config.json", [1, "x"]),
                                       ("config.json", -1), ("generation_config.json", True)])
def test_a_bad_eos_token_id_names_its_file(name, bad, folder):
    if name == "config.json":
        write(folder, name, json.load(open(f"{folder}/config.json")) | {"eos_token_id": bad})
    else:
        write(folder, name, {"eos_token_id": bad})
    with pytest.raises(ValueError, match=re.escape(f"{name}: eos_token_id={bad!r} is not a token id")):
        ModelConfig.from_pretrained(folder)


def test_our_writer_keeps_the_eos_ids(folder):
    for ids, field in (([3], 3), ([3, 9], [3, 9]), ([], None)):
        c = ModelConfig(**SHAPE, eos_token_ids=ids)
        assert hf_config_dict(c)["eos_token_id"] == field
        save_random_checkpoint(c, folder, seed=0)
        assert ModelConfig.from_pretrained(folder).eos_token_ids == ids


# -- EngineConfig takes the checkpoint's model ------------------------------------------------------------
def test_a_checkpoint_alone_gives_its_own_model(folder):
    cfg = EngineConfig(checkpoint=folder)
    assert cfg.model == ModelConfig.from_pretrained(folder)
    assert {k: getattr(cfg.model, k) for k in SHAPE} == SHAPE
    # what the worker does with it: the weights load (they did not with the default model)
    build_model(cfg.model).load_weights(folder)
    # ranks rebuild the config from its dump
    assert EngineConfig.model_validate(cfg.model_dump()) == cfg


def test_a_model_mapping_is_overrides_on_the_checkpoint(folder):
    text = f"engine:\n  checkpoint: {folder}\n  model:\n    dtype: bfloat16\n    rope_theta: 5000.0\n"
    cfg = EngineConfig.model_validate(yaml.safe_load(text)["engine"])
    assert cfg.model == ModelConfig.from_pretrained(folder, dtype="bfloat16", rope_theta=5000.0)
    # a shape field that agrees may be given too
    assert EngineConfig(checkpoint=folder, model={"hidden_size": 64}).model.hidden_size == 64
    # a bad override is reported on its field
    with pytest.raises(ValueError, match=r"model\.dtype"):
        EngineConfig(checkpoint=folder, model={"dtype": "float64"})


def test_a_full_model_that_agrees_is_taken_as_given(folder):
    """Non-shape fields are the caller's to choose (the accuracy gate sets layer_types and rope_theta)."""
    model = ModelConfig(**SHAPE, rope_theta=123.0, seed=9, layer_types=["sliding_attention"] * 2, sliding_window=8)
    assert EngineConfig(checkpoint=folder, model=model).model == model


@pytest.mark.parametrize("as_dict", [False, True])
def test_a_model_that_disagrees_is_refused_naming_each_field(as_dict, folder):
    bad = dict(hidden_size=128, num_hidden_layers=3)
    model = bad if as_dict else ModelConfig(**(SHAPE | bad))
    with pytest.raises(ValueError) as e:
        EngineConfig(checkpoint=folder, model=model)
    msg = str(e.value)
    assert f"model disagrees with checkpoint {folder!r}" in msg
    assert "hidden_size=128 (config.json: 64)" in msg and "num_hidden_layers=3 (config.json: 2)" in msg
    assert "vocab_size" not in msg  # only the fields that differ


@pytest.mark.parametrize("change, shown", [
    (dict(architecture="LlamaForCausalLM"), "architecture='LlamaForCausalLM' (config.json: 'Qwen2ForCausalLM')"),
    (dict(vocab_size=97), "vocab_size=97 (config.json: 96)"),
    (dict(intermediate_size=256), "intermediate_size=256 (config.json: 128)"),
    (dict(num_attention_heads=4, head_dim=32), "num_attention_heads=4 (config.json: 2)"),
    (dict(num_key_value_heads=2), "num_key_value_heads=2 (config.json: 1)"),
    (dict(head_dim=64), "head_size=64 (config.json: 32)"),
    (dict(tie_word_embeddings=True), "tie_word_embeddings=True (config.json: False)"),
])
def test_each_shape_field_is_checked(change, shown, folder):
    with pytest.raises(ValueError, match=re.escape(shown)):
        EngineConfig(checkpoint=folder, model=ModelConfig(**(SHAPE | change)))


def test_the_default_model_with_a_checkpoint_is_refused_on_the_driver(folder):
    """The old failure: ModelConfig() with another model's checkpoint, seen only in a worker."""
    with pytest.raises(ValueError, match=r"architecture='LlamaForCausalLM'.*vocab_size=512 \(config.json: 96\)"):
        EngineConfig(checkpoint=folder, model=ModelConfig())


def test_missing_folder_or_config_json_names_the_path(tmp_path):
    with pytest.raises(ValueError, match=rf"checkpoint folder '{tmp_path}/nope' does not exist"):
        EngineConfig(checkpoint=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match=rf"checkpoint folder '{tmp_path}' has no config.json"):
        EngineConfig(checkpoint=str(tmp_path))
    with pytest.raises(ValueError, match="has no config.json"):  # with a model given, too
        EngineConfig(checkpoint=str(tmp_path), model=ModelConfig())
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=rf"{tmp_path}/config.json: not valid JSON"):
        EngineConfig(checkpoint=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ModelConfig.from_pretrained(str(tmp_path / "nope"))


def test_no_checkpoint_keeps_the_model_as_given():
    assert EngineConfig().model == ModelConfig()
    assert EngineConfig(model={"hidden_size": 128}).model == ModelConfig(hidden_size=128)


def test_engine_serves_a_transformers_checkpoint_from_the_folder_alone(tmp_path):
    """Through the engine and its worker (in process): the folder is all the config there is, and
    greedy tokens are HF's."""
    from ray_attn.engine import LLMEngine, SamplingParams
    from ray_attn.runtime import InProcessExecutor
    from tests.model.test_families import reinit

    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, eos_token_id=None, bos_token_id=None)).eval()
    reinit(hf, seed=4, norm_offset=False)
    hf.save_pretrained(str(tmp_path))
    cfg = EngineConfig.model_validate({"checkpoint": str(tmp_path), "cache": {"num_blocks": 32},
                                       "parallel": {"device": "cpu", "kernel": "torch"}})
    engine = LLMEngine(cfg, InProcessExecutor(cfg))
    prompts = [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 23)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=8))
    for p, o in zip(prompts, outs):
        want = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, pad_token_id=0)[0, len(p):]
        assert o.output_token_ids == want.tolist()
