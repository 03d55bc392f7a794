"""Which FP8 weight schemes we serve, read from ``ModelConfig.quantization``; everything else is
refused here, by name, when the config is read (the driver validates it before any actor starts).

``ModelConfig.quantization`` is either the string ``"fp8"`` -- a full-precision checkpoint (or the
random weights) quantized when it loads, as vLLM's ``--quantization fp8`` -- or a checkpoint's own
``quantization_config`` (config.json), of one of two formats:

- ``compressed-tensors`` (llm-compressor), ``format: float-quantized``: FP8 e4m3 weights with
  per-output-channel ``weight_scale`` and dynamic per-token activations (the ``FP8_DYNAMIC``
  scheme), or a per-tensor ``weight_scale`` with a calibrated static ``input_scale`` (``FP8``).
- ``quant_method: fp8`` with ``weight_block_size: [128, 128]`` (Qwen's and DeepSeek's FP8
  releases): a float32 ``weight_scale_inv`` per 128 x 128 weight block, activations quantized per
  token and group of 128 input features.

The LM head, the embedding and the norms stay in the model dtype (as vLLM does); the linear layers
of attention (qkv, o) and of the dense MLP (gate_up, down) are quantized.  MoE families are
refused (their experts live in ``moe.py``, which has no FP8 path).

Torch-free on purpose: ``ray_attn.config`` imports this (lazily) to validate a config.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn
BLOCK_SIZE = (128, 128)  # the only weight_block_size we run (every published block-FP8 checkpoint)
ONLINE = "fp8"  # ModelConfig.quantization for online quantization at load
GGUF = "gguf"  # ModelConfig.quantization: a GGUF checkpoint's 4-bit blocks run as stored (model/gguf_q4.py)
QUANT_METHODS = ("fp8", "compressed-tensors")
# The modules a config may leave unquantized without changing our layers (ours never are).
ALWAYS_UNQUANTIZED = ("lm_head",)

WeightStrategy = Literal["channel", "tensor", "block"]
ActStrategy = Literal["token", "tensor", "group"]


@dataclass(frozen=True)
class Fp8Config:
    """One FP8 scheme, in vLLM's terms.

    ``weight_strategy``: ``channel`` (one scale per output row), ``tensor`` (one per checkpoint
    tensor; held per output row once loaded, see ``parallel_linear.ColumnParallelLinear``) or ``block``
    (one per 128 x 128 block).  ``activation_scheme`` ``dynamic`` computes the input's scales
    every call, per token (``token``) or per token and group of 128 features (``group``);
    ``static`` divides by the checkpoint's ``input_scale`` (``tensor``)."""
    quant_method: str  # "fp8" or "compressed-tensors": where the scheme came from, for messages
    is_checkpoint_fp8_serialized: bool  # False: quantize the loaded full-precision weights
    weight_strategy: WeightStrategy
    activation_scheme: Literal["dynamic", "static"]
    activation_strategy: ActStrategy
    weight_block_size: tuple[int, int] | None = None
    # Checkpoint module names (or ``re:`` patterns, compressed-tensors' form; plain names match
    # as substrings for ``modules_to_not_convert``, transformers' form) left unquantized.
    ignore: tuple[str, ...] = ()

    @property
    def scale_name(self) -> str:
        """The checkpoint suffix of a weight's scales (``weight_scale_inv`` is the block format's
        name; its values multiply, like ``weight_scale``'s, despite the name)."""
        return "weight_scale_inv" if self.quant_method == "fp8" and self.weight_strategy == "block" else "weight_scale"

    @property
    def group_size(self) -> int | None:
        return self.weight_block_size[1] if self.weight_strategy == "block" else None

    def describe(self) -> str:
        return (f"{self.quant_method} {self.weight_strategy} weights, {self.activation_scheme} per-"
                f"{self.activation_strategy} activations")

    def is_layer_skipped(self, module: str) -> bool:
        """Whether the checkpoint leaves ``module`` (e.g. ``model.layers.0.mlp.down_proj``)
        unquantized."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module):
                    return True
            elif entry == module or (self.quant_method == "fp8" and entry in module):
                return True
        return False


def _refuse(name: str, value, why: str):
    raise ValueError(f"quantization_config.{name}={value!r} is not supported ({why})")


def parse_quantization(value, architecture: str | None = None) -> Fp8Config | None:
    """The scheme ``ModelConfig.quantization`` asks for (None: unquantized), or a ValueError that
    names the field and value we do not run."""
    if value is None or value == GGUF:
        return None  # GGUF's 4-bit blocks (model/gguf_q4.py): no FP8 scheme
    if isinstance(value, str):
        if value != ONLINE:
            raise ValueError(f"quantization={value!r} is not supported; use {ONLINE!r} (online FP8 of a "
                             f"full-precision checkpoint), {GGUF!r} (a GGUF's 4-bit blocks as stored) or "
                             "leave it unset to take a checkpoint's own quantization_config (compressed-tensors "
                             "FP8, block-wise fp8)")
        return Fp8Config(ONLINE, False, "channel", "dynamic", "token")
    if not isinstance(value, dict):
        raise ValueError(f"quantization must be 'fp8', 'gguf', a checkpoint's quantization_config mapping or null, "
                         f"got {type(value).__name__}")
    method = value.get("quant_method")
    if method == "fp8":
        return _block_fp8(value)
    if method == "compressed-tensors":
        return _compressed_tensors(value)
    _refuse("quant_method", method, f"supported: {', '.join(QUANT_METHODS)}")


def _block_fp8(q: dict) -> Fp8Config:
    """transformers' FineGrainedFP8Config / vLLM's Fp8Config with a weight_block_size."""
    block = q.get("weight_block_size")
    if block is None:
        _refuse("weight_block_size", None, "per-tensor fp8 checkpoints are not implemented; block-wise fp8 "
                "needs weight_block_size [128, 128]")
    if list(block) != list(BLOCK_SIZE):
        _refuse("weight_block_size", block, "only [128, 128] blocks are implemented")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        _refuse("activation_scheme", q["activation_scheme"], "block-wise fp8 runs dynamic activations only")
    if q.get("fmt", "e4m3") != "e4m3":
        _refuse("fmt", q["fmt"], "only float8 e4m3 weights are implemented")
    if q.get("scale_fmt", "float") not in ("float", None):
        _refuse("scale_fmt", q["scale_fmt"], "only float32 block scales are implemented")
    ignore = tuple(q.get("modules_to_not_convert") or q.get("ignored_layers") or ())
    return Fp8Config("fp8", True, "block", "dynamic", "group", BLOCK_SIZE, ignore)


def _fp8_args(where: str, args: dict) -> None:
    for key, ok in (("num_bits", 8), ("type", "float"), ("symmetric", True)):
        if args.get(key, ok) != ok:
            _refuse(f"{where}.{key}", args.get(key), "only symmetric 8-bit float (FP8 e4m3) is implemented")


def _compressed_tensors(q: dict) -> Fp8Config:
    fmt = q.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        _refuse("format", fmt, "only FP8 checkpoints (format float-quantized) are implemented")
    for key in ("sparsity_config", "transform_config"):
        if q.get(key):
            _refuse(key, q[key], "sparse and transformed checkpoints are not implemented")
    if q.get("kv_cache_scheme"):
        _refuse("kv_cache_scheme", q["kv_cache_scheme"], "KV-cache quantization is CacheConfig.kv_cache_dtype's")
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        _refuse("config_groups", sorted(groups), "exactly one scheme for every Linear is implemented")
    (gname, g), = groups.items()
    where = f"config_groups.{gname}"
    if g.get("targets") != ["Linear"]:
        _refuse(f"{where}.targets", g.get("targets"), "only a scheme targeting every Linear is implemented")
    if g.get("output_activations"):
        _refuse(f"{where}.output_activations", g["output_activations"], "output quantization is not implemented")
    w, a = g.get("weights"), g.get("input_activations")
    if not w:
        _refuse(f"{where}.weights", w, "the scheme must quantize weights")
    _fp8_args(f"{where}.weights", w)
    if w.get("dynamic", False):
        _refuse(f"{where}.weights.dynamic", w["dynamic"], "weights must carry their scales")
    ws = w.get("strategy")
    if ws not in ("channel", "tensor"):
        _refuse(f"{where}.weights.strategy", ws, "FP8 weights per channel or per tensor are implemented")
    if not a:
        _refuse(f"{where}.input_activations", a, "weight-only FP8 (W8A16) is not implemented")
    _fp8_args(f"{where}.input_activations", a)
    dynamic, act = bool(a.get("dynamic", False)), a.get("strategy")
    if (dynamic, act) not in ((True, "token"), (False, "tensor")):
        _refuse(f"{where}.input_activations", dict(dynamic=dynamic, strategy=act),
                "dynamic per-token or static per-tensor FP8 activations are implemented")
    return Fp8Config("compressed-tensors", True, ws, "dynamic" if dynamic else "static", act,
                     ignore=tuple(q.get("ignore") or ()))


def check_model(scheme: Fp8Config | None, architecture: str, moe: bool) -> None:
    """Refuse a model family whose layers have no FP8 path."""
    if scheme is not None and moe:
        raise ValueError(f"quantization ({scheme.describe()}) is not implemented for the MoE family "
                         f"{architecture}: its experts (ray_attn/model/moe.py) have no FP8 path")
