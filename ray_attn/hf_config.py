"""HF ``config.json`` to ``ModelConfig`` fields, per architecture (the way back, a ``ModelConfig``
written as a config.json, is ``ray_attn.hf_export``).

Kept apart from the model modules (and free of torch) so that the driver validates a checkpoint's
config without building a model.  A config.json setting that would change what the checkpoint
computes and that we do not implement is refused by name, never ignored.
"""

from __future__ import annotations

from typing import Callable

DTYPES = ("float32", "bfloat16", "float16")
LLAMA_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
              "max_position_embeddings", "tie_word_embeddings", "sliding_window")
# config.json files without ``architectures`` (a config saved on its own) still name a model_type.
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mpt": "MptForCausalLM",
               "gemma2": "Gemma2ForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
               "llama4_text": "Llama4ForCausalLM", "llama4": "Llama4ForConditionalGeneration"}
# Checkpoints whose text decoder is one of our families: the multimodal Llama 4 holds a
# Llama4ForCausalLM under ``language_model.`` (config in ``text_config``; the vision tower is
# not loaded).
TEXT_PART_OF = {"Llama4ForConditionalGeneration": "Llama4ForCausalLM"}
GEMMA2_ACTIVATION = "gelu_pytorch_tanh"
# transformers' Qwen2Config / Qwen3Config defaults, for the keys a config.json may leave out (HF
# fills them from its class; ours differ, e.g. rms_norm_eps 1e-5 and a 512-token vocabulary).
QWEN_DEFAULTS = dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                     num_attention_heads=32, hidden_act="silu", max_position_embeddings=32768,
                     rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False,
                     sliding_window=4096, max_window_layers=28)
QWEN3_DEFAULTS = QWEN_DEFAULTS | dict(head_dim=128, attention_bias=False)
QWEN3_MOE_DEFAULTS = QWEN_DEFAULTS | dict(
    hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=4,
    attention_bias=False, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=False,
    decoder_sparse_step=1, mlp_only_layers=[])
MIXTRAL_DEFAULTS = dict(num_local_experts=8, num_experts_per_tok=2, hidden_act="silu")
# transformers' Llama4TextConfig defaults (Scout's shapes), for keys a config.json may leave out.
LLAMA4_DEFAULTS = dict(
    vocab_size=202048, hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384, num_hidden_layers=48,
    num_attention_heads=40, num_key_value_heads=8, head_dim=128, hidden_act="silu", max_position_embeddings=131072,
    rms_norm_eps=1e-5, num_experts_per_tok=1, num_local_experts=16, interleave_moe_layer_step=1, use_qk_norm=True,
    no_rope_layer_interval=4, attention_chunk_size=8192, attn_temperature_tuning=True, floor_scale=8192,
    attn_scale=0.1, attention_bias=False, tie_word_embeddings=False)


def _refuse(arch: str, name: str, value, why: str) -> None:
    raise ValueError(f"{arch} config.json: {name}={value!r} is not supported ({why})")


def _number(x):
    """Integral floats as ints: HF's strict configs type some of these fields int."""
    return int(x) if isinstance(x, float) and x.is_integer() else x


def eos_token_ids(value, where: str = "config.json") -> list[int]:
    """HF's ``eos_token_id`` (an int, a list of ints, or null) as a list."""
    ids = [] if value is None else [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{where}: eos_token_id={value!r} is not a token id, a list of them or null")
    return list(ids)


def _rope_in(hf: dict, default_theta: float = 10000.0) -> dict:
    rope = dict(hf.get("rope_parameters") or {})  # transformers 5 keeps theta and scaling here
    theta = hf.get("rope_theta", rope.pop("rope_theta", default_theta))
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    return dict(rope_theta=float(theta), rope_scaling=scaling)


# -- readers: config.json -> ModelConfig fields --------------------------------------------------
def _llama_in(hf: dict) -> dict:
    fields = {k: hf[k] for k in LLAMA_KEYS if hf.get(k) is not None}
    fields.setdefault("num_key_value_heads", fields.get("num_attention_heads"))
    if fields.get("sliding_window"):
        fields["layer_types"] = ["sliding_attention"] * fields["num_hidden_layers"]
    return fields | _rope_in(hf)


def _mpt_in(hf: dict) -> dict:
    arch, attn, ffn = "MptForCausalLM", hf.get("attn_config") or {}, hf.get("ffn_config") or {}
    # (setting, its value, the value(s) we compute, why the others are not)
    for name, value, ok, why in (
            ("attn_config.alibi", attn.get("alibi", True), (True,), "learned position embeddings are not implemented"),
            ("attn_config.attn_type", attn.get("attn_type", "multihead_attention"), ("multihead_attention",),
             "HF transformers' MPT runs multihead_attention only"),
            ("attn_config.qk_ln", attn.get("qk_ln", False), (False,), "q/k LayerNorm is not implemented"),
            ("attn_config.prefix_lm", attn.get("prefix_lm", False), (False,), "prefix-LM attention is not implemented"),
            ("attn_config.rope", attn.get("rope", False), (False,), "RoPE MPT variants are not implemented"),
            ("attn_config.sliding_window_size", attn.get("sliding_window_size", -1), (-1, None),
             "MPT sliding windows are not implemented"),
            ("no_bias", hf.get("no_bias", True), (True,), "biases are not implemented"),
            ("logit_scale", hf.get("logit_scale"), (None,), "logit scaling is not implemented; HF transformers ignores it too"),
            ("norm_type", hf.get("norm_type", "low_precision_layernorm"),
             ("low_precision_layernorm", "layernorm"), "only LayerNorm is implemented"),
            ("ffn_config.ffn_type", ffn.get("ffn_type", "mptmlp"), ("mptmlp",), "only the GELU MLP (mptmlp) is implemented"),
            ("ffn_config.ffn_act_fn", ffn.get("ffn_act_fn"), (None,), "only exact GELU is implemented")):
        if value not in ok:
            _refuse(arch, name, value, why)
    for key in ("d_model", "n_heads", "n_layers", "vocab_size"):
        if hf.get(key) is None:
            raise ValueError(f"{arch} config.json lacks {key}")
    d, n = hf["d_model"], hf["n_heads"]
    # Not expansion_ratio * d_model: HF transformers ignores expansion_ratio and writes (and reads)
    # a 4 * d_model MLP, so that is what a transformers checkpoint holds.  An llm-foundry
    # checkpoint of another ratio then fails to load, naming up_proj and both shapes.
    fields = dict(
        vocab_size=hf["vocab_size"], hidden_size=d, num_attention_heads=n, num_key_value_heads=n,
        num_hidden_layers=hf["n_layers"], intermediate_size=4 * d,
        max_position_embeddings=hf.get("max_seq_len", 2048),
        rms_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        tie_word_embeddings=hf.get("tie_word_embeddings", True), use_alibi=True,
        alibi_bias_max=float(attn.get("alibi_bias_max", 8)), softmax_scale=attn.get("softmax_scale"),
        clip_qkv=attn.get("clip_qkv"))
    return {k: v for k, v in fields.items() if v is not None}


def _gemma2_in(hf: dict) -> dict:
    arch = "Gemma2ForCausalLM"
    act = hf.get("hidden_activation") or hf.get("hidden_act") or GEMMA2_ACTIVATION
    if act != GEMMA2_ACTIVATION:
        _refuse(arch, "hidden_activation", act, f"only GeGLU with {GEMMA2_ACTIVATION} is implemented")
    if hf.get("attention_bias"):
        _refuse(arch, "attention_bias", True, "projection biases are not implemented")
    if hf.get("use_bidirectional_attention"):
        _refuse(arch, "use_bidirectional_attention", True, "only causal attention is implemented")
    if hf.get("num_hidden_layers") is None:
        raise ValueError(f"{arch} config.json lacks num_hidden_layers")
    fields = _llama_in(hf)
    n = fields["num_hidden_layers"]
    # HF's default pattern when the config has none: sliding on even layers, full on odd ones.
    kinds = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    if "sliding_attention" in kinds and not hf.get("sliding_window"):
        _refuse(arch, "sliding_window", hf.get("sliding_window"), "its sliding_attention layers need a window")
    fields.update(layer_types=list(kinds), tie_word_embeddings=hf.get("tie_word_embeddings", True),
                  logits_soft_cap=hf.get("attn_logit_softcapping"),
                  final_logit_soft_cap=hf.get("final_logit_softcapping"),
                  query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)))
    return {k: v for k, v in fields.items() if v is not None}


def _qwen_in(arch: str, hf: dict, defaults: dict) -> dict:
    hf = defaults | hf
    if hf["hidden_act"] != "silu":
        _refuse(arch, "hidden_act", hf["hidden_act"], "only SwiGLU with silu is implemented")
    if hf.get("attention_bias"):  # Qwen3's switch: biases on q, k, v and o
        _refuse(arch, "attention_bias", True, "Qwen3 projection biases are not implemented")
    n = hf["num_hidden_layers"]
    # HF's reading: the window applies only with use_sliding_window, to the layers from
    # max_window_layers on (unless the config lists layer_types itself); released Qwen2.5 and
    # Qwen3 configs carry a sliding_window with use_sliding_window false, i.e. no window at all.
    window = hf["sliding_window"] if hf["use_sliding_window"] else None
    kinds = hf.get("layer_types") or ["sliding_attention" if window is not None and i >= hf["max_window_layers"]
                                      else "full_attention" for i in range(n)]
    sliding = "sliding_attention" in kinds
    if sliding and window is None:
        _refuse(arch, "sliding_window", window, "its sliding_attention layers need a window, and "
                f"use_sliding_window={hf['use_sliding_window']!r} sets none")
    fields = {k: hf[k] for k in LLAMA_KEYS if hf.get(k) is not None and k != "sliding_window"}
    fields.setdefault("num_key_value_heads", fields["num_attention_heads"])
    fields.update(layer_types=list(kinds) if sliding else None, sliding_window=window if sliding else None)
    return {k: v for k, v in fields.items() if v is not None} | _rope_in(hf)


def _experts_in(arch: str, hf: dict, num_experts) -> dict:
    if not isinstance(num_experts, int) or num_experts <= 0:
        _refuse(arch, "num_experts", num_experts, "a sparse family needs routed experts")
    if hf.get("hidden_act", "silu") != "silu":
        _refuse(arch, "hidden_act", hf["hidden_act"], "only SwiGLU experts with silu are implemented")
    # router_aux_loss_coef, router_jitter_noise, output_router_logits: training only, ignored
    return dict(num_local_experts=num_experts, num_experts_per_tok=hf["num_experts_per_tok"])


def _mixtral_in(hf: dict) -> dict:
    hf = MIXTRAL_DEFAULTS | hf
    return _llama_in(hf) | _rope_in(hf, 1e6) | _experts_in("MixtralForCausalLM", hf, hf["num_local_experts"])


def _qwen3_moe_in(hf: dict) -> dict:
    arch = "Qwen3MoeForCausalLM"
    hf = QWEN3_MOE_DEFAULTS | {k: v for k, v in hf.items() if v is not None}
    E = hf.get("num_local_experts", hf["num_experts"])  # transformers 5 writes num_local_experts
    fields = _qwen_in(arch, hf, {}) | _experts_in(arch, hf, E)
    n, step, dense = fields["num_hidden_layers"], hf["decoder_sparse_step"], set(hf["mlp_only_layers"] or [])
    if not isinstance(step, int) or step <= 0:
        _refuse(arch, "decoder_sparse_step", step, "must be a positive layer interval")
    # HF's rule (Qwen3MoeDecoderLayer): sparse unless in mlp_only_layers, every decoder_sparse_step-th layer
    sparse = [i for i in range(n) if i not in dense and (i + 1) % step == 0]
    return fields | dict(moe_intermediate_size=hf["moe_intermediate_size"], norm_topk_prob=bool(hf["norm_topk_prob"]),
                         moe_layers=None if len(sparse) == n else sparse)


def _llama4_in(hf: dict) -> dict:
    arch = "Llama4ForCausalLM"
    hf = LLAMA4_DEFAULTS | {k: v for k, v in hf.items() if v is not None or k == "attention_chunk_size"}
    if hf.get("attention_bias"):
        _refuse(arch, "attention_bias", True, "projection biases are not implemented")
    n = hf["num_hidden_layers"]
    # transformers' Llama4TextConfig.__post_init__, for configs that leave these out
    rope = hf.get("no_rope_layers") or [int((i + 1) % hf["no_rope_layer_interval"] != 0) for i in range(n)]
    step = hf["interleave_moe_layer_step"]
    moe = hf.get("moe_layers")
    if moe is None:
        if not isinstance(step, int) or step <= 0:
            _refuse(arch, "interleave_moe_layer_step", step, "must be a positive layer interval")
        moe = list(range(step - 1, n, step))
    chunk = hf.get("attention_chunk_size")
    kinds = hf.get("layer_types") or ["chunked_attention" if r and chunk is not None else "full_attention"
                                      for r in rope[:n]]
    if "sliding_attention" in kinds:
        _refuse(arch, "layer_types", kinds, "Llama 4 has chunked and full attention layers only")
    fields = {k: hf[k] for k in LLAMA_KEYS if hf.get(k) is not None and k not in ("sliding_window", "intermediate_size")}
    fields.update(
        intermediate_size=hf["intermediate_size_mlp"], moe_intermediate_size=hf["intermediate_size"],
        shared_expert_intermediate_size=hf["intermediate_size"], moe_layers=None if len(moe) == n else list(moe),
        no_rope_layers=[int(bool(r)) for r in rope[:n]], use_qk_norm=bool(hf["use_qk_norm"]),
        attn_temperature_tuning=bool(hf["attn_temperature_tuning"]), floor_scale=float(hf["floor_scale"]),
        attn_scale=float(hf["attn_scale"]), layer_types=list(kinds),
        attention_chunk_size=chunk if "chunked_attention" in kinds else None)
    return fields | _rope_in(hf, 500000.0) | _experts_in(arch, hf, hf["num_local_experts"])


READERS: dict[str, Callable[[dict], dict]] = {
    "LlamaForCausalLM": _llama_in, "MistralForCausalLM": _llama_in, "MptForCausalLM": _mpt_in,
    "Gemma2ForCausalLM": _gemma2_in,
    "Qwen2ForCausalLM": lambda hf: _qwen_in("Qwen2ForCausalLM", hf, QWEN_DEFAULTS),
    "Qwen3ForCausalLM": lambda hf: _qwen_in("Qwen3ForCausalLM", hf, QWEN3_DEFAULTS),
    "MixtralForCausalLM": _mixtral_in, "Qwen3MoeForCausalLM": _qwen3_moe_in, "Llama4ForCausalLM": _llama4_in}


def architecture_of(hf: dict, folder: str = "") -> str:
    names = hf.get("architectures") or []
    if not names:
        model_type = hf.get("model_type")
        if model_type is None:
            return "LlamaForCausalLM"  # a bare Llama-style config, as this library has always read
        if model_type not in MODEL_TYPES:
            raise ValueError(f"{folder}: config.json has no architectures and model_type={model_type!r} "
                             f"is not supported; supported model types: {', '.join(MODEL_TYPES)}")
        return MODEL_TYPES[model_type]
    for name in names:
        if name in READERS or name in TEXT_PART_OF:
            return name
    raise ValueError(f"{folder}: architectures={names} is not supported; supported architectures: "
                     f"{', '.join([*READERS, *TEXT_PART_OF])}")


def fields_from_hf(hf: dict, folder: str = "") -> dict:
    """``ModelConfig`` fields from an HF config.json's contents."""
    arch = architecture_of(hf, folder)
    dtype = str(hf.get("dtype") or hf.get("torch_dtype") or "float32").replace("torch.", "")
    eos = hf.get("eos_token_id")
    quant = hf.get("quantization_config")  # a multimodal checkpoint's is at the top level
    if arch in TEXT_PART_OF:
        text = hf.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(f"{folder}: {arch} config.json lacks its text_config")
        eos = text.get("eos_token_id", eos)
        quant = text.get("quantization_config", quant)
        hf, arch = text, TEXT_PART_OF[arch]
    fields = dict(architecture=arch, dtype=dtype if dtype in DTYPES else "bfloat16",
                  eos_token_ids=eos_token_ids(eos, f"{folder}/config.json"))
    if quant is not None:  # its scheme is checked (and refused by name) by ModelConfig
        if not isinstance(quant, dict):
            raise ValueError(f"{folder}/config.json: quantization_config must be a mapping, got {type(quant).__name__}")
        fields["quantization"] = quant
    return READERS[arch](hf) | fields
