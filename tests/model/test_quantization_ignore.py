"""Which layers a quantized checkpoint leaves unquantized (``Fp8Config.is_layer_skipped``), as the
tools that wrote it decide: compressed-tensors matches an ``ignore`` entry to a module name exactly,
or by its regex when it starts with ``re:`` -- never as a substring, so ``mlp.gate`` (a MoE router)
does not skip ``mlp.gate_proj``.  The block-wise fp8 format is transformers' FineGrainedFP8, whose
``modules_to_not_convert`` entries match as substrings of the name (its loader's rule)."""

from __future__ import annotations

import pytest

from ray_attn.model.quantization import parse_quantization

# A test extra (the reference for the matching rule): the GPU machine's kit lacks it, and a module
# that cannot import there stopped `pytest -m gpu tests/model` at collection.
pytest.importorskip("compressed_tensors")
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme  # noqa: E402
from compressed_tensors.utils.match import match_name  # noqa: E402

NAMES = ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.gate", "model.layers.0.mlp.up_proj",
         "model.layers.10.self_attn.q_proj", "model.layers.1.self_attn.q_proj", "lm_head",
         "model.layers.0.self_attn.o_proj"]
TARGETS = ["model.layers.0.mlp.gate", "mlp.gate_proj", "lm_head", "model.layers.1.self_attn.q_proj",
           "re:.*mlp\\.gate$", "re:model\\.layers\\.1\\..*", "re:.*o_proj", "self_attn",
           "re:mlp\\.gate_proj"]  # re.match anchors at the start: this regex skips nothing here


def _compressed_tensors(ignore):
    return parse_quantization(QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])},
        ignore=list(ignore), format="float-quantized").model_dump(mode="json"))


@pytest.mark.parametrize("target", TARGETS)
def test_compressed_tensors_ignore_matches_as_compressed_tensors_does(target):
    cfg = _compressed_tensors([target])
    assert {n: cfg.is_layer_skipped(n) for n in NAMES} == {n: match_name(n, target) for n in NAMES}


def test_a_router_entry_does_not_skip_the_gate_proj_beside_it():
    cfg = _compressed_tensors(["model.layers.0.mlp.gate"])
    assert cfg.is_layer_skipped("model.layers.0.mlp.gate")
    assert not cfg.is_layer_skipped("model.layers.0.mlp.gate_proj")


def test_several_entries_any_of_them():
    cfg = _compressed_tensors(["lm_head", "re:.*o_proj"])
    for n in NAMES:
        assert cfg.is_layer_skipped(n) == any(match_name(n, t) for t in ("lm_head", "re:.*o_proj"))


@pytest.mark.parametrize("entry,name,skipped", [("mlp.gate", "model.layers.0.mlp.gate_proj", True),
                                                ("lm_head", "lm_head", True), ("o_proj", "model.layers.0.mlp.down_proj", False)])
def test_block_fp8_modules_to_not_convert_match_as_substrings(entry, name, skipped):
    cfg = parse_quantization({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                              "modules_to_not_convert": [entry]})
    assert cfg.is_layer_skipped(name) is skipped
