"""Logits of our paged, chunked-prefill + decode run against HF transformers on the same checkpoint.

Tolerance: atol 1e-4 in float32.  Both sides compute the same math in float32, but with different
summation orders (fused vs separate projections, paged vs dense softmax), which leaves differences
around 1e-6 on logits of magnitude ~1; a real bug (a wrong position, mask or head mapping) moves
them by 1e-2 or more: the default random scales keep attention peaked, so masks and RoPE matter
(checked by hand: dropping the chunk or window mask moves logits by ~2).
"""

from __future__ import annotations

import pytest
import torch

from ray_attn.config import ModelConfig
from ray_attn.model import LlamaForCausalLM, save_random_checkpoint
from tests.model.steps import BLOCK_SIZE, SCHEDULE, random_tokens, run_schedule

transformers = pytest.importorskip("transformers")
ATOL = 1e-4


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256)
    return ModelConfig(**(base | kw))


def ours(config, folder, chunk=None):
    model = LlamaForCausalLM(config, block_size=BLOCK_SIZE, kernel="torch")
    model.load_weights(str(folder))
    tokens = random_tokens(config.vocab_size)
    return tokens, run_schedule(model, tokens, SCHEDULE, chunk=chunk)


def hf_logits(hf, tokens):
    with torch.no_grad():
        return [hf(torch.tensor(t)[None]).logits[0].float() for t in tokens]


def assert_close(got, want):
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert (g - w).abs().max().item() < ATOL, (g - w).abs().max().item()
        assert w.std() > 0.1  # the check means something


def test_gqa_rope_matches_hf_llama(tmp_path):
    config = tiny(rope_theta=5000.0, rms_norm_eps=1e-6)
    save_random_checkpoint(config, str(tmp_path), seed=1)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager",
                                                        dtype=torch.float32).eval()
    tokens, got = ours(config, tmp_path)
    assert_close(got, hf_logits(hf, tokens))
    # The default random model is alive: its next-token choice follows the context.
    assert len(set(torch.cat(got).argmax(-1).tolist())) > 20


def test_tied_embeddings_match_hf_llama(tmp_path):
    config = tiny(tie_word_embeddings=True, num_key_value_heads=1)
    save_random_checkpoint(config, str(tmp_path), seed=2)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    tokens, got = ours(config, tmp_path)
    assert_close(got, hf_logits(hf, tokens))


def test_sliding_window_matches_hf_mistral(tmp_path):
    config = tiny(sliding_window=8, layer_types=["sliding_attention"] * 3)
    save_random_checkpoint(config, str(tmp_path), seed=3)
    hf_config = transformers.MistralConfig(**{k: getattr(config, k) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "sliding_window")},
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta})
    hf = transformers.MistralForCausalLM.from_pretrained(str(tmp_path), config=hf_config,
                                                          attn_implementation="eager",
                                                          dtype=torch.float32).eval()
    tokens, got = ours(config, tmp_path)
    assert_close(got, hf_logits(hf, tokens))


def masked_attention(kinds, *, window, chunk, softcap):
    """HF attention hook: dense eager attention with this layer's own mask (full, sliding or
    chunked-local) -- the per-layer masks HF Llama has no switch for."""
    def forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
        g = query.shape[1] // key.shape[1]
        k, v = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
        s = query @ k.transpose(2, 3) * scaling
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        qp = torch.arange(s.shape[-2])[:, None]
        kp = torch.arange(s.shape[-1])[None, :]
        keep = kp <= qp
        kind = kinds[module.layer_idx]
        if kind == "sliding_attention":
            keep &= kp > qp - window
        if kind == "chunked_attention":
            keep &= kp // chunk == qp // chunk
        p = torch.softmax(s.masked_fill(~keep, float("-inf")), -1)
        return (p @ v).transpose(1, 2).contiguous(), p
    return forward


def test_mixed_layer_kinds_and_soft_cap_match_hf_with_per_layer_masks(tmp_path):
    kinds = ["chunked_attention", "sliding_attention", "full_attention"]
    config = tiny(layer_types=kinds, sliding_window=12, attention_chunk_size=32, logits_soft_cap=3.0)
    save_random_checkpoint(config, str(tmp_path), seed=4)
    name = "ray_attn_per_layer_masks"
    transformers.AttentionInterface.register(name, masked_attention(kinds, window=12, chunk=32, softcap=3.0))
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), attn_implementation=name,
                                                        dtype=torch.float32).eval()
    tokens, got = ours(config, tmp_path, chunk=32)
    assert_close(got, hf_logits(hf, tokens))
    # The chunk mask is what makes the match: without local metadata the model refuses to run.
    model = LlamaForCausalLM(config, block_size=BLOCK_SIZE)
    model.init_random_weights(0)
    with pytest.raises(ValueError, match="local_attn_metadata"):
        run_schedule(model, tokens, SCHEDULE)
