"""On a GPU: the flash-attn kernels inside the model agree with the torch reference kernel."""

from __future__ import annotations

import pytest
import torch

from ray_attn.config import ModelConfig
from ray_attn.model import LlamaForCausalLM, build_model, save_random_checkpoint
from tests.model.steps import BLOCK_SIZE, SCHEDULE, random_tokens, run_schedule

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("layer_types", [None, ["chunked_attention", "sliding_attention"]])
def test_fa3_matches_torch_kernel_in_bf16(layer_types):
    pytest.importorskip("flash_attn_interface")
    cfg = ModelConfig(vocab_size=256, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=128, dtype="bfloat16",
                      sliding_window=24, attention_chunk_size=32, layer_types=layer_types)
    tokens = random_tokens(cfg.vocab_size)
    out = {}
    for kernel in ("fa3", "torch"):
        model = LlamaForCausalLM(cfg, device="cuda", block_size=BLOCK_SIZE, kernel=kernel)
        model.init_random_weights(3)
        assert model.kernel_name == kernel
        out[kernel] = torch.cat(run_schedule(model, tokens, SCHEDULE, chunk=32, device="cuda"))
    # bf16 activations: the kernels round differently, so compare at bf16's resolution.
    diff = (out["fa3"] - out["torch"]).abs().max().item()
    assert diff < 0.05 * out["torch"].abs().max().item(), diff


def bf16_vs_float32(arch: str, folder: str, device: str, kernel: str) -> tuple[float, float]:
    """Max |logit difference| of the bf16 model on ``device`` against float32 on CPU, both loaded
    from one bf16 checkpoint, and the float32 logits' max |value|."""
    cfg = ModelConfig(architecture=arch, vocab_size=256, hidden_size=512, intermediate_size=1024,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                      dtype="bfloat16")
    save_random_checkpoint(cfg, folder, seed=5)
    tokens = random_tokens(cfg.vocab_size)
    model = build_model(cfg, device=device, block_size=BLOCK_SIZE, kernel=kernel)
    model.load_weights(folder)
    got = torch.cat(run_schedule(model, tokens, SCHEDULE, device=device))
    ref = build_model(ModelConfig(**(cfg.model_dump() | {"dtype": "float32"})), block_size=BLOCK_SIZE, kernel="torch")
    ref.load_weights(folder)  # the same bf16 values, computed in float32
    want = torch.cat(run_schedule(ref, tokens, SCHEDULE))
    return (got - want).abs().max().item(), want.abs().max().item()


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_qwen_biases_and_qk_norm_on_gpu(arch, tmp_path):
    """FA3, the fused Triton RMSNorm on q/k views (Qwen3) and in-place RoPE, q/k/v biases (Qwen2),
    against float32 on CPU; bf16 activations, so at bf16's resolution as above."""
    pytest.importorskip("flash_attn_interface")
    diff, scale = bf16_vs_float32(arch, str(tmp_path), "cuda", "fa3")
    assert diff < 0.05 * scale, (diff, scale)


MOE_GPU = {
    "Qwen3MoeForCausalLM": dict(num_local_experts=16, num_experts_per_tok=4, moe_intermediate_size=256,
                                norm_topk_prob=True, moe_layers=[1]),
    "MixtralForCausalLM": dict(num_local_experts=8, num_experts_per_tok=2),
    "Llama4ForCausalLM": dict(num_local_experts=8, num_experts_per_tok=1, moe_intermediate_size=512,
                              moe_layers=[1], no_rope_layers=[1, 0], use_qk_norm=True, attn_temperature_tuning=True,
                              floor_scale=16.0, attention_chunk_size=32,
                              layer_types=["chunked_attention", "full_attention"]),
}


@pytest.mark.parametrize("arch", list(MOE_GPU))
def test_moe_families_on_gpu(arch, tmp_path):
    """The sparse families on CUDA in bf16 -- the grouped-GEMM experts, FA3, Llama 4's chunked
    layers -- against float32 on CPU (the expert loop), from one bf16 checkpoint; bf16
    activations, so at bf16's resolution as above."""
    pytest.importorskip("flash_attn_interface")
    cfg = ModelConfig(architecture=arch, vocab_size=256, hidden_size=512, intermediate_size=1024,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                      dtype="bfloat16", **MOE_GPU[arch])
    save_random_checkpoint(cfg, str(tmp_path), seed=5)
    tokens = random_tokens(cfg.vocab_size)
    chunk = cfg.attention_chunk_size
    model = build_model(cfg, device="cuda", block_size=BLOCK_SIZE, kernel="fa3")
    model.load_weights(str(tmp_path))
    from ray_attn.model.moe import SparseMoeBlock, grouped_mm_supported

    block = next(m for m in model.modules() if isinstance(m, SparseMoeBlock))
    x = torch.zeros(2, cfg.hidden_size, dtype=torch.bfloat16, device="cuda")
    assert grouped_mm_supported(x, block.experts.w13, block.experts.w2)  # the path under test
    got = torch.cat(run_schedule(model, tokens, SCHEDULE, chunk=chunk, device="cuda"))
    ref = build_model(ModelConfig(**(cfg.model_dump() | {"dtype": "float32"})), block_size=BLOCK_SIZE, kernel="torch")
    ref.load_weights(str(tmp_path))
    want = torch.cat(run_schedule(ref, tokens, SCHEDULE, chunk=chunk))
    # Per position: a router near-tie that bf16 breaks the other way swaps one of the token's
    # experts (a genuine bf16 effect, not a bug), so up to 5% of positions may miss; a wrong
    # offset, permutation or slice misses on most of them.
    rows, scale = (got - want).abs().amax(-1), want.abs().max().item()
    assert (rows < 0.05 * scale).float().mean().item() >= 0.95, (rows.tolist(), scale)
    assert rows.median().item() < 0.02 * scale, (rows.median().item(), scale)
