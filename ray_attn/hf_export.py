"""A ``ModelConfig`` written as the config.json HF transformers loads its family from: the tests'
checkpoints, and the check that a config is one its family's config.json can hold at all
(``model/registry.py`` calls it before it builds a model).

The reverse of ``ray_attn.hf_config``, in a module of its own: the readers run while a
``ModelConfig`` is validated, the writers take one, so one module holding both would import the
config module that imports it.
"""

from __future__ import annotations

from typing import Callable

from ray_attn.hf_config import GEMMA2_ACTIVATION, _number
from ray_attn.model_config import ModelConfig


def _rope_out(c: ModelConfig) -> dict:
    return {"rope_type": "default", "rope_theta": c.rope_theta, **(c.rope_scaling or {})}


# -- writers: ModelConfig -> config.json ----------------------------------------------------------
def _only(c: ModelConfig, held: set[str]) -> None:
    """Refuse a config whose other fields differ from their defaults: that family's config.json
    has no place for them, so a checkpoint would silently compute something else."""
    fields = type(c).model_fields
    for name in fields:
        if name not in held | {"architecture", "dtype", "seed", "eos_token_ids", "quantization"} and getattr(c, name) != fields[name].default:
            raise ValueError(f"a {c.architecture} config.json cannot hold {name}={getattr(c, name)!r}")


def _llama_out(c: ModelConfig) -> dict:
    exclude = {"seed", "dtype", "architecture", "eos_token_ids", "quantization"} | (set() if c.use_alibi else {"alibi_bias_max"})
    d = c.model_dump(exclude=exclude, exclude_none=True)
    d.update(architectures=[c.architecture],
             model_type="mistral" if c.architecture == "MistralForCausalLM" else "llama",
             hidden_act="silu", head_dim=c.head_size, attention_bias=False, mlp_bias=False,
             rope_parameters=_rope_out(c))
    return d


def _mpt_out(c: ModelConfig) -> dict:
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


def _gemma2_out(c: ModelConfig) -> dict:
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


def _qwen_out(c: ModelConfig, moe: set[str] = frozenset()) -> dict:
    _only(c, {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "rope_theta", "rope_scaling", "rms_norm_eps",
              "max_position_embeddings", "tie_word_embeddings", "sliding_window", "layer_types"} | moe)
    kinds = c.layer_kinds()
    if "chunked_attention" in kinds:
        raise ValueError(f"a {c.architecture} config.json cannot hold chunked_attention layer_types")
    sliding = "sliding_attention" in kinds
    d = {k: getattr(c, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                    "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                                    "max_position_embeddings", "tie_word_embeddings")}
    # layer_types carries any pattern; max_window_layers (the full layers before the first sliding
    # one) is what readers without layer_types go by, exact for HF's full-then-sliding pattern.
    full_first = kinds.index("sliding_attention") if sliding else len(kinds)
    qwen3 = c.architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    return d | dict(
        architectures=[c.architecture], model_type="qwen3" if qwen3 else "qwen2", head_dim=c.head_size,
        hidden_act="silu", use_sliding_window=sliding, sliding_window=c.sliding_window if sliding else None,
        max_window_layers=full_first, layer_types=kinds, rope_parameters=_rope_out(c),
        **(dict(attention_bias=False) if qwen3 else {}))


_EXPERT_FIELDS = {"num_local_experts", "num_experts_per_tok"}


def _qwen3_moe_out(c: ModelConfig) -> dict:
    d = _qwen_out(c, _EXPERT_FIELDS | {"moe_intermediate_size", "norm_topk_prob", "moe_layers"})
    sparse = set(c.moe_layer_ids)
    return d | dict(model_type="qwen3_moe", num_experts=c.num_local_experts, num_experts_per_tok=c.num_experts_per_tok,
                    moe_intermediate_size=c.expert_intermediate_size, norm_topk_prob=c.norm_topk_prob,
                    decoder_sparse_step=1, mlp_only_layers=[i for i in range(c.num_hidden_layers) if i not in sparse])


def _mixtral_out(c: ModelConfig) -> dict:
    _only(c, {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "rope_theta", "rope_scaling", "rms_norm_eps",
              "max_position_embeddings", "tie_word_embeddings", "sliding_window", "layer_types",
              "norm_topk_prob"} | _EXPERT_FIELDS)
    kinds = c.layer_kinds()
    if set(kinds) - {"sliding_attention"} and set(kinds) - {"full_attention"}:
        raise ValueError(f"a MixtralForCausalLM config.json holds one sliding_window for every layer, not {kinds}")
    d = {k: getattr(c, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                    "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                                    "max_position_embeddings", "tie_word_embeddings", "num_local_experts",
                                    "num_experts_per_tok")}
    return d | dict(architectures=["MixtralForCausalLM"], model_type="mixtral", head_dim=c.head_size,
                    hidden_act="silu", rope_parameters=_rope_out(c),
                    sliding_window=c.sliding_window if "sliding_attention" in kinds else None)


def _llama4_out(c: ModelConfig) -> dict:
    _only(c, {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "rope_theta", "rope_scaling", "rms_norm_eps",
              "max_position_embeddings", "tie_word_embeddings", "attention_chunk_size", "layer_types",
              "moe_intermediate_size", "shared_expert_intermediate_size", "moe_layers", "no_rope_layers",
              "use_qk_norm", "attn_temperature_tuning", "floor_scale", "attn_scale", "norm_topk_prob"} | _EXPERT_FIELDS)
    kinds = c.layer_kinds()
    if "sliding_attention" in kinds:
        raise ValueError("a Llama4ForCausalLM config.json cannot hold sliding_attention layer_types")
    d = {k: getattr(c, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                    "num_key_value_heads", "rms_norm_eps", "max_position_embeddings",
                                    "tie_word_embeddings", "num_local_experts", "num_experts_per_tok",
                                    "use_qk_norm", "attn_temperature_tuning", "attn_scale")}
    return d | dict(
        architectures=["Llama4ForCausalLM"], model_type="llama4_text", head_dim=c.head_size, hidden_act="silu",
        intermediate_size=c.expert_intermediate_size, intermediate_size_mlp=c.intermediate_size,
        moe_layers=list(c.moe_layer_ids), interleave_moe_layer_step=1, layer_types=kinds,
        no_rope_layers=list(c.no_rope_layers or [1] * c.num_hidden_layers),
        attention_chunk_size=c.attention_chunk_size, floor_scale=_number(c.floor_scale), attention_bias=False,
        rope_parameters=_rope_out(c))


WRITERS: dict[str, Callable[[ModelConfig], dict]] = {
    "LlamaForCausalLM": _llama_out, "MistralForCausalLM": _llama_out, "MptForCausalLM": _mpt_out,
    "Gemma2ForCausalLM": _gemma2_out, "Qwen2ForCausalLM": _qwen_out, "Qwen3ForCausalLM": _qwen_out,
    "MixtralForCausalLM": _mixtral_out, "Qwen3MoeForCausalLM": _qwen3_moe_out, "Llama4ForCausalLM": _llama4_out}


def hf_config_dict(config: ModelConfig) -> dict:
    """The config.json HF transformers loads ``config``'s family from."""
    ids = config.eos_token_ids
    if isinstance(config.quantization, dict):
        # Its tensors are the quantizing tool's; a config.json written here would describe weights
        # we did not write.  (Online 'fp8' is a loading option: nothing of it goes in config.json.)
        raise ValueError("a quantized checkpoint's config.json comes from the tool that quantized it; "
                         f"cannot write quantization={config.quantization.get('quant_method')!r}")
    # transformers 5 reads dtype, 4 torch_dtype
    return WRITERS[config.architecture](config) | dict(
        dtype=config.dtype, torch_dtype=config.dtype, eos_token_id=ids[0] if len(ids) == 1 else ids or None)
