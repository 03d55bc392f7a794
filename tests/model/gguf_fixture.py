"""Small GGUF files of random HF models, written with ``gguf``'s own writer as llama.cpp's
convert_hf_to_gguf.py writes them: its metadata keys, its tensor names (``gguf``'s
``TensorNameMap``), Llama's q/k rows permuted for llama.cpp's RoPE, norms in F32 and every matrix
in the chosen tensor type (``gguf.quants.quantize``).  Types the Python ``gguf`` cannot quantize
(the K-quants) are written as random blocks with finite scales, which dequantize like any other."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}  # HF model_type -> general.architecture
# Where the f16 super-block scales sit in each K-quant block (byte offsets): set to a small
# finite value, so random bytes dequantize to finite weights of order 1e-2.
K_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """convert_hf_to_gguf.py's ``LlamaModel.permute``: HF's rotate-half row order to llama.cpp's
    interleaved pairs, within each head."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encode(w: np.ndarray, qtype: str, rng: np.random.Generator) -> tuple[np.ndarray, object]:
    import gguf

    t = gguf.GGMLQuantizationType[qtype]
    if qtype in K_SCALES:  # no Python quantizer: random blocks with small scales
        block, size = gguf.GGML_QUANT_SIZES[t]
        q = rng.integers(0, 256, (w.shape[0], w.shape[1] // block, size), dtype=np.uint8)
        for off in K_SCALES[qtype]:
            q[..., off:off + 2] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
        return q.reshape(w.shape[0], -1), t
    return gguf.quants.quantize(w, t), t


def write_gguf(hf, path: Path | str, qtype: str = "F32", *, embed_qtype: str | None = None,
               tokenizer=None, chat_template: str | None = None, seed: int = 0,
               architecture: str | None = None, extra_tensors: dict | None = None) -> Path:
    """``hf`` (a transformers Llama / Qwen2 / Qwen3 causal LM) as a GGUF at ``path``; matrices
    in ``qtype``, the embedding in ``embed_qtype`` (default ``qtype``).  ``tokenizer`` (a
    byte-level BPE ``PreTrainedTokenizerFast``) goes into the metadata as a "gpt2" tokenizer.
    ``architecture`` overrides general.architecture; ``extra_tensors`` adds raw tensors."""
    import gguf

    c = hf.config
    arch_name = architecture or ARCH[c.model_type]
    # Tensor names of the model's own family, whatever ``architecture`` the metadata claims.
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == ARCH[c.model_type])
    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch_name)
    n, heads, kv = c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta", getattr(c, "rope_theta", 10000.0))
    w.add_name(f"tiny-{c.model_type}")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(n)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(float(theta))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if qtype == "F32" else gguf.LlamaFileType.MOSTLY_Q8_0)
    if arch_name == "llama":
        w.add_rope_dimension_count(head_dim)
    else:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if tokenizer is not None:
        vocab = tokenizer.get_vocab()
        tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
        specials = set(tokenizer.all_special_tokens) | set(tokenizer.added_tokens_encoder)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens])
        import json

        merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
        w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
        w.add_eos_token_id(tokenizer.eos_token_id)
        if tokenizer.pad_token_id is not None:
            w.add_pad_token_id(tokenizer.pad_token_id)
        w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(chat_template)
    rng = np.random.default_rng(seed)
    names = gguf.get_tensor_name_map(arch, n)
    for name, p in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        module, suffix = name.rsplit(".", 1)
        gname = names.get_name(module) + "." + suffix
        data = p.detach().float().numpy()
        if arch_name == "llama" and module.endswith("q_proj"):
            data = permute(data, heads, heads)
        elif arch_name == "llama" and module.endswith("k_proj"):
            data = permute(data, heads, kv)
        if data.ndim == 1:
            w.add_tensor(gname, np.ascontiguousarray(data, np.float32))
            continue
        q, t = encode(np.ascontiguousarray(data), embed_qtype or qtype if module.endswith("embed_tokens") else qtype, rng)
        w.add_tensor(gname, q, raw_dtype=t)
    for gname, (data, t) in (extra_tensors or {}).items():
        w.add_tensor(gname, data, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_hf(model_type: str, seed: int = 0, **kw):
    """A random transformers model of the family, small enough for a test (every matrix dim a
    multiple of 256, the K-quants' block, where ``kw`` asks for them)."""
    import transformers

    from tests.model.test_families import reinit

    base = dict(vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[model_type]
    if model_type == "qwen3":
        base["head_dim"] = 128  # transformers reads no head size from a qwen3 GGUF: Qwen3Config's default
    hf = cls[1](cls[0](**(base | kw))).eval()
    reinit(hf, seed)
    if model_type == "qwen2":  # q/k/v biases: nonzero, so a dropped bias shows
        with torch.no_grad():
            g = torch.Generator().manual_seed(seed + 1)
            for name, p in hf.named_parameters():
                if name.endswith("bias"):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return hf
