"""The Hugging Face side of the accuracy gate: checkpoints written by transformers, and what HF
computes on them (float32 teacher forcing, a bf16 ``generate`` control).

Checkpoints are built with ``AutoModelForCausalLM.from_config`` and ``save_pretrained``, so every
tensor name, layout and ``config.json`` field is what transformers writes.  Their weights are
re-drawn at scales that keep the model "alive" (see :func:`liven`): with transformers' default
0.02 init a random model's attention is near-uniform and its logits nearly tied, so a wrong mask
or position barely moves the argmax and the gate would pass almost anything.

Features that no HF family we load computes natively (chunked-local layers on a Llama checkpoint)
run on HF with its attention replaced by :func:`masked_attention`, registered through
transformers' ``AttentionInterface``: HF's model code does everything else.
"""

from __future__ import annotations

import inspect

import torch

# family -> (transformers config class, fields for the "gpu" and "cpu" sizes)
GPU_SIZE = dict(vocab=32768, hidden=2048, layers=6, heads=16, kv_heads=4, head=128, inter=5632, max_pos=4096)
CPU_SIZE = dict(vocab=512, hidden=128, layers=2, heads=4, kv_heads=2, head=32, inter=256, max_pos=2048)


def hf_config(family: str, size: dict, *, window: int, chunk: int | None = None):
    """``chunk``: Llama 4's attention_chunk_size (``llama4``, ``llama4_onechunk``)."""
    import transformers as tf

    s = size
    common = dict(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["inter"],
                  num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                  num_key_value_heads=s["kv_heads"], head_dim=s["head"],
                  max_position_embeddings=s["max_pos"], bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)
    if family == "llama":
        return tf.LlamaConfig(**common, rope_theta=500000.0, tie_word_embeddings=False)
    if family == "mistral":
        return tf.MistralConfig(**common, rope_theta=1e6, sliding_window=window, tie_word_embeddings=False)
    if family == "gemma2":
        return tf.Gemma2Config(**common, sliding_window=window, query_pre_attn_scalar=s["head"],
                               attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                               hidden_activation="gelu_pytorch_tanh")
    if family == "qwen2":
        # Tied embeddings, as the small Qwen2.5 checkpoints ship.
        return tf.Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                              tie_word_embeddings=True, use_sliding_window=False)
    if family == "qwen3":
        # Twice the query heads, so q is wider than the residual stream (Qwen3-4B: 32 x 128 over 2560).
        return tf.Qwen3Config(**(common | dict(num_attention_heads=2 * s["heads"])), attention_bias=False,
                              rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False)
    if family == "mixtral":
        # 8 experts, top-2 renormalised (Mixtral's routing), half-width experts
        return tf.MixtralConfig(**(common | dict(intermediate_size=s["inter"] // 2)), num_local_experts=8,
                                num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                tie_word_embeddings=False)
    if family == "qwen3_moe":
        # 16 narrow experts, top-4 renormalised, q/k norms; the first layer dense (mlp_only_layers)
        return tf.Qwen3MoeConfig(**common, moe_intermediate_size=s["inter"] // 4, num_experts=16,
                                 num_experts_per_tok=4, norm_topk_prob=True, mlp_only_layers=[0],
                                 rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False)
    if family in ("llama4", "llama4_onechunk", "llama4_c512"):
        # Scout's pattern over >= 4 layers: RoPE + chunked-local on 3 of 4, NoPE + full attention
        # (temperature tuning, at a floor_scale small enough to act within the prompts) on every
        # 4th; L2 q/k norm; MoE (8 experts, sigmoid top-1, shared expert) on alternate layers,
        # dense SwiGLU of intermediate_size_mlp between.
        layers = max(s["layers"], 4)
        return tf.Llama4TextConfig(
            **(common | dict(num_hidden_layers=layers, intermediate_size=s["inter"] // 2)),
            intermediate_size_mlp=s["inter"], num_local_experts=8, num_experts_per_tok=1, interleave_moe_layer_step=2,
            no_rope_layers=[int((i + 1) % 4 != 0) for i in range(layers)], attention_chunk_size=chunk,
            use_qk_norm=True, attn_temperature_tuning=True, floor_scale=max(chunk // 4, 8), attn_scale=0.1,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=False)
    if family == "mpt":
        # HF's MPT builds (and writes) a 4 * d_model MLP whatever expansion_ratio says.
        return tf.MptConfig(d_model=s["hidden"], n_heads=s["heads"], n_layers=s["layers"], max_seq_len=s["max_pos"],
                            vocab_size=s["vocab"], attn_config={"alibi": True, "alibi_bias_max": 8})
    raise ValueError(f"unknown family {family!r}")


@torch.no_grad()
def liven(model: torch.nn.Module, seed: int) -> None:
    """Re-draw every weight: matrices N(0, 1/fan_in), so activations keep unit scale through each
    layer and attention stays peaked; an untied input embedding N(0, 1) (each position's own token
    stays visible in the residual stream), a tied one N(0, 1/hidden) so logits are of order 1;
    norm weights near 1 but not exactly (a skipped norm shows), biases (Qwen2's q/k/v) N(0, 0.25):
    half the projections' unit scale, so a dropped or misplaced bias shows too."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    tied = bool(getattr(cfg, "tie_word_embeddings", False)) or getattr(cfg, "model_type", "") == "mpt"
    gemma = getattr(cfg, "model_type", "").startswith("gemma")
    llama4 = getattr(cfg, "model_type", "").startswith("llama4")  # stacked experts stored input-major
    embed = model.get_input_embeddings().weight
    for name, p in model.named_parameters():
        x = torch.randn(p.shape, generator=g, dtype=torch.float32)
        if p is embed:
            std = p.shape[-1] ** -0.5 if tied else 1.0
            p.copy_(x * std)
        elif p.dim() == 1 and "norm" in name.lower():
            p.copy_(x * 0.05 if gemma else 1.0 + x * 0.05)  # Gemma scales by (1 + w)
        elif p.dim() == 1:
            p.copy_(x * 0.5)
        else:
            fan_in = p.shape[-2] if llama4 and p.dim() == 3 else p.shape[-1]
            p.copy_(x * fan_in ** -0.5)


def write_checkpoint(family: str, folder: str, *, size: dict, seed: int, dtype: torch.dtype, window: int,
                     init: str = "alive", chunk: int | None = None):
    """``init="hf"`` keeps transformers' own random init (std 0.02): near-tied logits, where any
    perturbation -- bf16 rounding included -- flips many argmaxes (a baseline, not a gate)."""
    import transformers as tf

    cfg = hf_config(family, size, window=window, chunk=chunk)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if init == "alive":
        liven(model, seed)
    model.to(dtype).save_pretrained(folder)


def masked_attention(layer_kinds, *, chunk: int | None, window: int | None = None, softcap: float = 0.0,
                     kv_round=None):
    """An HF attention function (``AttentionInterface``) with each layer's own mask -- full,
    sliding or chunked-local -- bottom-right aligned, so it also serves ``generate``'s cached decode
    steps.  ``kv_round(q, k, v)`` lets a control round q/K/V as an fp8 cache would."""
    def forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
        if kv_round is not None:
            query, key, value = kv_round(query, key, value)
        g = query.shape[1] // key.shape[1]
        k, v = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
        s = (query.float() @ k.float().transpose(2, 3)) * scaling
        cap = kw.get("softcap") or softcap
        if cap:
            s = cap * torch.tanh(s / cap)
        Lq, Lk = s.shape[-2], s.shape[-1]
        qp = torch.arange(Lq, device=s.device)[:, None] + (Lk - Lq)
        kp = torch.arange(Lk, device=s.device)[None, :]
        keep = kp <= qp
        kind = layer_kinds[module.layer_idx]
        w = kw.get("sliding_window") or window
        if kind == "sliding_attention":
            keep &= kp > qp - w
        if kind == "chunked_attention":
            keep &= kp // chunk == qp // chunk
        p = torch.softmax(s.masked_fill(~keep, float("-inf")), -1)
        return (p.to(v.dtype) @ v).transpose(1, 2).contiguous(), p
    return forward


def fp8_rounder(q_scale: float = 1.0, k_scale: float = 1.0, v_scale: float = 1.0, round_q: bool = True):
    """Round q/K/V to e4m3 at the given scales and back, as an fp8 KV cache (and FlashAttention 3's
    fp8 query) would: the format's own error, with no implementation in between."""
    def rnd(x, s):
        return ((x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).to(x.dtype)
    return lambda q, k, v: (rnd(q, q_scale) if round_q else q, rnd(k, k_scale), rnd(v, v_scale))


def load_hf(folder: str, dtype: torch.dtype, device, attention: str = "sdpa"):
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attention)
    return model.to(device).eval()


@torch.no_grad()
def teacher_forced_argmax(model, prompt: list[int], output: list[int]) -> list[int]:
    """HF's argmax at each generated position, given the same history the engine had."""
    seq = torch.tensor([prompt + output], device=model.device)
    logits = model(seq).logits[0, len(prompt) - 1: len(prompt) + len(output) - 1]
    return logits.argmax(-1).tolist()


@torch.no_grad()
def greedy_generate(model, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def agreement(model, prompts, outputs) -> float:
    """Share of generated tokens that are HF's argmax given the same history."""
    hits = total = 0
    for p, o in zip(prompts, outputs):
        want = teacher_forced_argmax(model, p, o)
        hits += sum(a == b for a, b in zip(want, o))
        total += len(o)
    return hits / max(total, 1)


# ---------------------------------------------------------------------- structured outputs
def byte_vocab(vocab: int, seed: int = 0, alphabet: str = 'abcdefghijklmnopqrstuvwxyz0123456789 {}[]":,.-',
               longest: int = 6) -> list[bytes]:
    """A vocabulary for grammars on a checkpoint without a tokenizer: the 256 bytes, then distinct
    2-``longest`` character pieces of ``alphabet`` (token 0, the byte 0x00, never occurs in JSON:
    it is the stop token)."""
    import random

    rnd = random.Random(seed)
    out, seen = [bytes([i]) for i in range(min(256, vocab))], set()
    while len(out) < vocab:
        piece = "".join(rnd.choice(alphabet) for _ in range(rnd.randint(2, longest))).encode()
        if piece not in seen:
            seen.add(piece)
            out.append(piece)
    return out


def _mask(state, device) -> torch.Tensor:
    """The grammar state's allowed next tokens as the int32 bitmask rank 0 applies (either backend)."""
    from ray_attn.structured_output import fill_bitmask

    return torch.from_numpy(fill_bitmask([state])).to(device)


@torch.no_grad()
def masked_greedy_generate(model, prompt: list[int], max_tokens: int, new_matcher, vocab: int) -> list[int]:
    """HF's greedy decode under the grammar, with HF's own KV cache as its ``generate`` runs (a
    forward of the whole history per token took ~40 of the CPU gate row's 55 s); ``new_matcher()``
    gives a fresh ``structured_output.GrammarState`` of the request's grammar."""
    from ray_attn.runtime.logits_processors import apply_token_bitmask

    # transformers 5.2x names the cache argument (and output) ``cache``; older ones (the GPU
    # machine's 5.17) ``past_key_values``
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    m, out, past, feed = new_matcher(), [], None, prompt
    while len(out) < max_tokens and not m.terminated:
        res = model(torch.tensor([feed], device=model.device), use_cache=True, **{kw: past})
        past, logits = getattr(res, kw), res.logits[0, -1:, :vocab].float()
        tok = int(apply_token_bitmask(logits, _mask(m, model.device)).argmax())
        assert m.accept(tok)
        out.append(tok)
        feed = [tok]
    return out


@torch.no_grad()
def masked_agreement(model, prompts, outputs, new_matcher, vocab: int) -> float:
    """``agreement`` under the grammar: HF's argmax over the tokens the grammar allows at each
    generated position, given the same history (the matcher follows the engine's tokens)."""
    from ray_attn.runtime.logits_processors import apply_token_bitmask

    hits = total = 0
    for p, o in zip(prompts, outputs):
        logits = model(torch.tensor([p + o], device=model.device)).logits[0, len(p) - 1: len(p) + len(o) - 1, :vocab]
        m = new_matcher()
        for i, tok in enumerate(o):
            want = int(apply_token_bitmask(logits[i:i + 1].float(), _mask(m, model.device)).argmax())
            hits += want == tok
            total += 1
            if not m.accept(tok):
                total += len(o) - i - 1  # the engine left the grammar: the rest cannot agree
                break
    return hits / max(total, 1)
