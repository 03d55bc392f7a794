"""scripts/fp8_checkpoints.py: the accuracy gate's FP8 checkpoints are what the real tools read.

transformers (with compressed-tensors' ``dequantize=True``, and its FineGrainedFP8 integration,
which dequantizes on CPU) loads each written checkpoint to the float32 weights that
``write_dequantized`` gives HF in the gate (exactly; compressed-tensors rounds code x scale to its
scales' dtype, bf16 here, where the gate keeps it exact as the engine's float32 accumulators do); the online kind's float32 copy holds exactly the
weights our engine quantizes at load."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import fp8_checkpoints as f8c  # noqa: E402

from ray_attn.config import ModelConfig  # noqa: E402
from ray_attn.model import build_model  # noqa: E402
from ray_attn.model import fp8 as F8  # noqa: E402

# whole 128-blocks everywhere (transformers' FineGrainedFP8 refuses ragged ones)
SHAPES = dict(vocab_size=96, hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=128, max_position_embeddings=256)


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bf16")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPES))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    model.to(torch.bfloat16).save_pretrained(str(folder))
    return str(folder)


def linears(model) -> dict[str, torch.Tensor]:
    return {n: m.weight.detach().float() for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n.endswith("_proj")}


@pytest.mark.parametrize("kind", ["compressed_tensors", "block"])
def test_transformers_reads_the_written_checkpoint_as_its_dequantized_copy(kind, bf16_checkpoint, tmp_path):
    if kind == "compressed_tensors":
        pytest.importorskip("compressed_tensors")
        kw = dict(quantization_config=transformers.utils.quantization_config.CompressedTensorsConfig(dequantize=True))
    else:
        pytest.importorskip("accelerate")
        kw = {}
    fp8_dir = f8c.write_fp8_checkpoint(bf16_checkpoint, str(tmp_path / "fp8"), kind)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(fp8_dir, dtype=torch.float32, **kw)
    ours = transformers.AutoModelForCausalLM.from_pretrained(
        f8c.write_dequantized(fp8_dir, str(tmp_path / "hf"), kind), dtype=torch.float32)
    full = linears(transformers.AutoModelForCausalLM.from_pretrained(bf16_checkpoint, dtype=torch.float32))
    a, b = linears(theirs), linears(ours)
    assert a.keys() == b.keys() == full.keys() and len(a) == 14
    # compressed-tensors dequantizes in its scales' dtype (bf16 here): code x scale rounded to it
    rounded = (lambda t: t.to(torch.bfloat16).float()) if kind == "compressed_tensors" else (lambda t: t)
    for name in a:
        torch.testing.assert_close(a[name], rounded(b[name]), rtol=0, atol=0, msg=name)
        err = (b[name] - full[name]).abs() / full[name].abs().amax()
        assert 0 < err.max() <= 2 ** -4, (name, err.max())  # quantized: moved, by at most half an e4m3 step


def test_online_copy_holds_the_weights_the_engine_quantizes(bf16_checkpoint, tmp_path):
    cfg = ModelConfig.from_pretrained(bf16_checkpoint, dtype="bfloat16", quantization="fp8")
    model = build_model(cfg, block_size=16, kernel="torch")
    model.load_weights(bf16_checkpoint)
    want = linears(transformers.AutoModelForCausalLM.from_pretrained(
        f8c.write_dequantized(bf16_checkpoint, str(tmp_path / "hf"), "online"), dtype=torch.float32))
    qkv = model.get_submodule("layers.1.self_attn.qkv_proj")
    got = F8.dequantize_weight(qkv.weight, qkv.weight_scale, qkv.scheme)
    q, k = want["model.layers.1.self_attn.q_proj"], want["model.layers.1.self_attn.k_proj"]
    torch.testing.assert_close(got[:q.shape[0]], q, rtol=0, atol=0)
    torch.testing.assert_close(got[q.shape[0]:q.shape[0] + k.shape[0]], k, rtol=0, atol=0)


def test_act_round_groups_of_128_and_tokens():
    x = torch.randn(3, 256, dtype=torch.float64)
    x[1, 128:] *= 100  # one group far larger: per group, the first group keeps its own scale
    v, s = f8c.act_round(x, "group")
    assert v.shape == (3, 2, 128) and s.shape == (3, 2, 1)
    assert torch.allclose(v.abs().amax(-1), torch.full((3, 2), 448.0, dtype=torch.float64))
    v, s = f8c.act_round(x, "token")
    assert s.shape == (3, 1) and v[1, :128].abs().max() < 10  # per token: the small group loses range
