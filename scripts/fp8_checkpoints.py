"""FP8 checkpoints in the formats users download, and the Hugging Face side's view of them.

Written from the formats' definitions, not from ``ray_attn.model.fp8`` (the code they check):

- ``compressed_tensors``: llm-compressor's ``FP8_DYNAMIC`` as compressed-tensors stores it
  (``format: float-quantized``): e4m3 weights, one ``weight_scale`` per output channel ([N, 1], in
  the checkpoint's dtype, ``amax / 448``), activations quantized per token at run time;
- ``block``: Qwen's and DeepSeek's FP8 releases (``quant_method: fp8``, ``weight_block_size:
  [128, 128]``): one float32 ``weight_scale_inv`` per 128 x 128 block, activations per token and
  group of 128;
- ``online``: a full-precision checkpoint that the engine quantizes when it loads (vLLM's
  ``--quantization fp8``): per output row, as ``compressed_tensors``, in float32.

``write_dequantized`` writes the same weights back as float32 (code x scale, exactly), for HF to
run; ``act_round`` / ``add_activation_rounding`` apply a format's activation quantization to HF's
linear layers (the accuracy gate's control, and the CPU parity tests' reference).
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
MIN_SCALE = 1.0 / (E4M3_MAX * 512.0)  # an all-zero row's scale (vLLM's MIN_SCALING_FACTOR)
KINDS = ("online", "compressed_tensors", "block")
ACT = {"online": "token", "compressed_tensors": "token", "block": "group"}
BLOCK_QCONFIG = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic", "fmt": "e4m3"}
# compressed-tensors' config for FP8_DYNAMIC, as its ModelCompressor writes it into config.json
CT_DYNAMIC_QCONFIG = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head"], "kv_cache_scheme": None, "global_compression_ratio": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"], "output_activations": None,
        "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False,
                    "observer": "minmax", "group_size": None, "block_structure": None, "actorder": None},
        "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                              "dynamic": True, "observer": None, "group_size": None, "block_structure": None,
                              "actorder": None}}}}


def is_quantized_linear(name: str, t: torch.Tensor) -> bool:
    """The decoder's linear weights (attention and MLP projections); not the embedding, the LM
    head, the norms or a MoE router."""
    return t.dim() == 2 and name.endswith("_proj.weight") and ".layers." in name


def block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The block format's definition: one scale (max |w| / 448) per 128 x 128 block."""
    N, K = w.shape
    nb, kb = -(-N // 128), -(-K // 128)
    blocks = F.pad(w.double(), (0, kb * 128 - K, 0, nb * 128 - N)).view(nb, 128, kb, 128)
    scale = (blocks.abs().amax(dim=(1, 3)) / E4M3_MAX).float()
    q = (blocks / scale.double()[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return q.reshape(nb * 128, kb * 128)[:N, :K].contiguous(), scale


def channel_quantize(w: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per output row, ``amax / 448`` held in ``scale_dtype`` (compressed-tensors keeps
    the checkpoint's dtype; online quantization float32); codes of w / (that scale)."""
    scale = (w.float().abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp(min=MIN_SCALE).to(scale_dtype)
    return (w.float() / scale.float()).clamp(-E4M3_MAX, E4M3_MAX).to(FP8), scale


def dequantize(name: str, tensors: dict, kind: str) -> torch.Tensor:
    """float32 weight ``name`` of a checkpoint of ``kind`` (``online``: its full-precision
    weight, quantized per row as the engine does at load)."""
    w = tensors[name]
    if kind == "online":
        q, s = channel_quantize(w, torch.float32)
    elif kind == "block":
        q, s = w, tensors[name + "_scale_inv"]
        s = s.float().repeat_interleave(128, 0)[:q.shape[0]].repeat_interleave(128, 1)[:, :q.shape[1]]
    else:
        q, s = w, tensors[name + "_scale"]
    return q.float() * s.float()


def _load(folder: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            out |= load_file(os.path.join(folder, f))
    return out


def _save(folder: str, tensors: dict, config: dict, src: str) -> None:
    import shutil

    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    for f in os.listdir(src):  # tokenizer, generation config... everything but weights and config
        if not f.endswith(".safetensors") and f not in ("config.json", "model.safetensors.index.json") \
                and os.path.isfile(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), folder)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


def write_fp8_checkpoint(src: str, dst: str, kind: str) -> str:
    """``src`` (a full-precision checkpoint transformers wrote) stored as ``kind``; ``online``
    returns ``src`` itself (the engine quantizes it)."""
    if kind == "online":
        return src
    if kind not in KINDS:
        raise ValueError(f"unknown FP8 checkpoint kind {kind!r}; one of {KINDS}")
    tensors = _load(src)
    config = json.load(open(os.path.join(src, "config.json")))
    for name in [n for n, t in tensors.items() if is_quantized_linear(n, t)]:
        w = tensors[name]
        if kind == "block":
            tensors[name], tensors[name + "_scale_inv"] = block_quantize(w)
        else:
            tensors[name], tensors[name + "_scale"] = channel_quantize(w, w.dtype)
    config["quantization_config"] = BLOCK_QCONFIG if kind == "block" else CT_DYNAMIC_QCONFIG
    _save(dst, tensors, config, src)
    return dst


def write_dequantized(src: str, dst: str, kind: str) -> str:
    """The weights of ``src`` (an FP8 checkpoint of ``kind``, or for ``online`` a full-precision
    one) as a float32 checkpoint without a quantization_config: the same model for HF to run."""
    tensors = _load(src)
    config = json.load(open(os.path.join(src, "config.json")))
    config.pop("quantization_config", None)
    config["torch_dtype"] = config["dtype"] = "float32"
    out = {}
    for name, t in tensors.items():
        if name.endswith(("_scale", "_scale_inv")):
            continue
        out[name] = dequantize(name, tensors, kind) if (t.dtype == FP8 or (kind == "online" and
                                                                          is_quantized_linear(name, t))) \
            else t.float()
    _save(dst, out, config, src)
    return dst


def act_round(x: torch.Tensor, act: str, input_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(v, s): x / s clamped to +-448, where s is the activation scale of a format -- per token
    (``token``), per token and group of 128 features (``group``, v and s grouped [..., G, 128]) or
    a calibrated ``input_scale`` (``static``).  ``v.to(e4m3) * s`` is the quantized activation."""
    if act == "group":
        x = x.unflatten(-1, (-1, 128))
    s = input_scale.to(x.dtype) if act == "static" else (x.abs().amax(-1, keepdim=True) / E4M3_MAX).clamp(min=MIN_SCALE)
    return (x / s).clamp(-E4M3_MAX, E4M3_MAX), s


def add_activation_rounding(model: torch.nn.Module, act: str) -> list:
    """Forward pre-hooks on HF's linear layers (not the LM head, not a MoE router) that quantize
    their inputs as ``act`` says, computed in float32 and cast back (as the kernels read bf16
    activations into float32 registers).  Returns the hooks' handles."""
    def hook(module, args):
        x = args[0]
        v, s = act_round(x.float(), act)
        return ((v.to(FP8).float() * s).view(x.shape).to(x.dtype),)

    return [m.register_forward_pre_hook(hook) for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n.endswith("_proj")]
