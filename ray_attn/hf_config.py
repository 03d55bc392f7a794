"""HF ``config.json`` to ``ModelConfig`` fields and back, per architecture.

Kept apart from the model modules (and free of torch) so that the driver validates a checkpoint's
config without building a model.  A config.json setting that would change what the checkpoint
computes and that we do not implement is refused by name, never ignored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from ray_attn.config import ModelConfig

DTYPES = ("float32", "bfloat16", "float16")
LLAMA_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
              "max_position_embeddings", "tie_word_embeddings", "sliding_window")
# config.json files without ``architectures`` (a config saved on its own) still name a model_type.
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mpt": "MptForCausalLM",
               "gemma2": "Gemma2ForCausalLM"}
GEMMA2_ACTIVATION = "gelu_pytorch_tanh"


def _refuse(arch: str, name: str, value, why: str) -> None:
    raise ValueError(f"{arch} config.json: {name}={value!r} is not supported ({why})")


def _number(x):
    """Integral floats as ints: HF's strict configs type some of these fields int."""
    return int(x) if isinstance(x, float) and x.is_integer() else x


def _rope_in(hf: dict) -> dict:
    rope = dict(hf.get("rope_parameters") or {})  # transformers 5 keeps theta and scaling here
    theta = hf.get("rope_theta", rope.pop("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    return dict(rope_theta=float(theta), rope_scaling=scaling)


def _rope_out(c: "ModelConfig") -> dict:
    return {"rope_type": "default", "rope_theta": c.rope_theta, **(c.rope_scaling or {})}


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


READERS: dict[str, Callable[[dict], dict]] = {
    "LlamaForCausalLM": _llama_in, "MistralForCausalLM": _llama_in, "MptForCausalLM": _mpt_in,
    "Gemma2ForCausalLM": _gemma2_in}


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
        if name in READERS:
            return name
    raise ValueError(f"{folder}: architectures={names} is not supported; supported architectures: "
                     f"{', '.join(READERS)}")


def fields_from_hf(hf: dict, folder: str = "") -> dict:
    """``ModelConfig`` fields from an HF config.json's contents."""
    arch = architecture_of(hf, folder)
    dtype = str(hf.get("dtype") or hf.get("torch_dtype") or "float32").replace("torch.", "")
    return READERS[arch](hf) | dict(architecture=arch, dtype=dtype if dtype in DTYPES else "bfloat16")


# -- writers: ModelConfig -> config.json ----------------------------------------------------------
def _only(c: "ModelConfig", held: set[str]) -> None:
    """Refuse a config whose other fields differ from their defaults: that family's config.json
    has no place for them, so a checkpoint would silently compute something else."""
    fields = type(c).model_fields
    for name in fields:
        if name not in held | {"architecture", "dtype", "seed"} and getattr(c, name) != fields[name].default:
            raise ValueError(f"a {c.architecture} config.json cannot hold {name}={getattr(c, name)!r}")


def _llama_out(c: "ModelConfig") -> dict:
    exclude = {"seed", "dtype", "architecture"} | (set() if c.use_alibi else {"alibi_bias_max"})
    d = c.model_dump(exclude=exclude, exclude_none=True)
    d.update(architectures=[c.architecture],
             model_type="mistral" if c.architecture == "MistralForCausalLM" else "llama",
             hidden_act="silu", head_dim=c.head_size, attention_bias=False, mlp_bias=False,
             rope_parameters=_rope_out(c))
    return d


def _mpt_out(c: "ModelConfig") -> dict:
    _only(c, {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
              "tie_word_embeddings", "use_alibi", "alibi_bias_max", "softmax_scale", "clip_qkv"})
    E, H = c.hidden_size, c.num_attention_heads
    if c.head_size * H != E:
        raise ValueError(f"MptForCausalLM: head_dim={c.head_size} must be hidden_size / num_attention_heads "
                         f"= {E / H:g} (config.json derives it)")
    return dict(
        architectures=["MptForCausalLM"], model_type="mpt", vocab_size=c.vocab_size, d_model=E, n_heads=H,
        n_layers=c.num_hidden_layers, expansion_ratio=4,
        max_seq_len=c.max_position_embeddings, layer_norm_epsilon=c.rms_norm_eps, no_bias=True,
        tie_word_embeddings=c.tie_word_embeddings,
        attn_config=dict(attn_type="multihead_attention", alibi=True, alibi_bias_max=_number(c.alibi_bias_max),
                         softmax_scale=c.softmax_scale, clip_qkv=c.clip_qkv))


def _gemma2_out(c: "ModelConfig") -> dict:
    _only(c, {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "rope_theta", "rope_scaling", "rms_norm_eps",
              "max_position_embeddings", "tie_word_embeddings", "sliding_window", "layer_types",
              "logits_soft_cap", "final_logit_soft_cap", "query_pre_attn_scalar"})
    if "chunked_attention" in c.layer_kinds():
        raise ValueError("a Gemma2ForCausalLM config.json cannot hold chunked_attention layer_types")
    d = {k: getattr(c, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                    "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                                    "max_position_embeddings", "tie_word_embeddings", "sliding_window")}
    return d | dict(
        architectures=["Gemma2ForCausalLM"], model_type="gemma2", head_dim=c.head_size,
        hidden_activation=GEMMA2_ACTIVATION, attention_bias=False, layer_types=c.layer_kinds(),
        attn_logit_softcapping=c.logits_soft_cap, final_logit_softcapping=c.final_logit_soft_cap,
        query_pre_attn_scalar=_number(c.query_pre_attn_scalar or c.head_size), rope_parameters=_rope_out(c))


WRITERS: dict[str, Callable[["ModelConfig"], dict]] = {
    "LlamaForCausalLM": _llama_out, "MistralForCausalLM": _llama_out, "MptForCausalLM": _mpt_out,
    "Gemma2ForCausalLM": _gemma2_out}


def hf_config_dict(config: "ModelConfig") -> dict:
    """The config.json HF transformers loads ``config``'s family from."""
    # transformers 5 reads dtype, 4 torch_dtype
    return WRITERS[config.architecture](config) | dict(dtype=config.dtype, torch_dtype=config.dtype)
