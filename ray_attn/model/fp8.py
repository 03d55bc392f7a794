"""FP8 (e4m3) linear layers: quantize and dequantize, and y = x W^T on every path.

The math every path computes (vLLM's Fp8LinearMethod and its block-wise variant):

    y[m, n] = sum_k  q(x)[m, k] * sx[m, g(k)]  *  Wq[n, k] * sw[n or n // 128, g(k)]

with ``q(x) = fp8(clamp(x / sx, +-448))`` in float32, ``sx`` the activation scale (dynamic per
token: ``max|x[m]| / 448``; per token and group of 128 features for block weights; a static
``input_scale``), and ``sw`` the weight's scales (per output row, or per 128 x 128 block).

- CPU (and any case no GPU kernel serves): ``dequant``, the reference -- the activation
  quantize-dequantized, the weight dequantized, one float32 matmul, the result cast to x's dtype.
  Float32, not the activation dtype: the GPU kernels apply the scales to a float32 accumulator,
  so a bf16 dequantized weight would add a rounding they do not have.
- CUDA, per-row weight scales, dynamic activations: x quantized per token by one Triton kernel,
  then ``torch._scaled_mm`` (row-wise scales [M, 1] and [1, N], e4m3 operands, the weight
  column-major) above ``SKINNY_MAX_M`` rows, and at decode sizes the skinny tensor-core kernel
  (``fp8_kernels.fp8_skinny``).
- CUDA, block weights: a Triton kernel (``_fp8_block_kernel``) whose K step is one 128-group, so
  it quantizes each group of x as it loads it and applies both block scales to that step's
  partial product; ``block_dequant`` (dequantize the weight, bf16 matmul) is the slower fallback.

Activations are quantized on every path, decode included: a W8A16 GEMV would be more accurate,
but then a token's logits would depend on whether its step ran the GEMV or the GEMM.  That GEMV
exists as ``w8a16`` (the bf16 GEMV reading e4m3 weights, the row scales applied to its float32
sums; one row, CUDA, dynamic activation schemes).  It runs where this GPU's tuned table
(``kernel_configs``) holds it for the weight's shape -- ``scripts/tune_decode_gemv.py --write``
puts it there only where it beat the skinny kernel -- or when forced (``RAY_ATTN_FP8_KERNEL=w8a16``).
Weight-only, the norm before it does not quantize, and down_proj makes SiLU-mul itself.
``select_fp8_kernel`` is the one place that picks a path (``RAY_ATTN_FP8_KERNEL`` forces one, for
measurements).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ray_attn.backend.triton_ops import available
from ray_attn.model import gemv, kernel_configs
from ray_attn.model.fp8_kernels import (FP8_DTYPE, GROUP, MIN_SCALE, block_config, fp8_block_matmul,  # noqa: F401
                                        fp8_skinny, quantize_per_token_triton, skinny_config)
from ray_attn.model.quantization import FP8_E4M3_MAX, Fp8Config

FP8_MAX = FP8_E4M3_MAX
# Rows up to which the skinny kernel serves per-row-scaled weights (decode); above, _scaled_mm.
# scripts/bench_fp8.py on the H200: skinny ahead of _scaled_mm at every shape up to 64 rows.
SKINNY_MAX_M = 64
KERNELS = ("auto", "dequant", "scaled_mm", "skinny", "w8a16", "block_triton", "block_dequant")
# RAY_ATTN_FP8_KERNEL forces a path where it can run (an A/B switch for benchmarks; read at import,
# and ``fp8.FORCE`` may be set by a script).
FORCE = os.environ.get("RAY_ATTN_FP8_KERNEL", "auto")
if FORCE not in KERNELS:
    raise ValueError(f"RAY_ATTN_FP8_KERNEL={FORCE!r} is not one of {KERNELS}")


# RAY_ATTN_FUSED_QUANT=0: the norm and SiLU-mul before an FP8 linear leave quantizing to the
# linear's own quantizer launch (an A/B switch for benchmarks; read at import).
FUSED_QUANT = os.environ.get("RAY_ATTN_FUSED_QUANT", "1") != "0"


@dataclass(frozen=True)
class QuantizedActivation:
    """An activation in the model dtype with its e4m3 codes and per-row scales, quantized by the
    kernel that made it (``fused.rms_norm(..., quant=True)``, ``fused.silu_mul``): the FP8 linear
    after it (``apply_fp8_linear(..., pre=)``) then launches no quantizer.  ``x`` stays for LoRA
    and for the paths that quantize on their own."""

    x: torch.Tensor  # [..., K]
    xq: torch.Tensor  # [M, K] e4m3: quantize_per_token(x)'s codes
    xs: torch.Tensor  # [M, 1] float32


def plain(x):
    """The model-dtype tensor of an activation that may come quantized."""
    return x.x if isinstance(x, QuantizedActivation) else x


# -- quantize / dequantize (torch; the reference every kernel is held to) ------------------------
def _to_fp8(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # Division, not a multiply by 1 / scale: the kernels divide too (IEEE-rounded), so the same
    # value rounds to the same e4m3 code everywhere.
    return (t.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def amax_scale(amax: torch.Tensor) -> torch.Tensor:
    # Divided by a tensor, not the Python number: CUDA turns a division by a host scalar into a
    # multiplication by its reciprocal, which rounds some scales one ulp off the IEEE quotient
    # that the CPU and the Triton kernels compute (and flips the codes near rounding midpoints).
    amax = amax.float()
    return (amax / torch.full_like(amax, FP8_MAX)).clamp_(min=MIN_SCALE)


def quantize_per_row(w: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights [N, K] -> (fp8 [N, K], float32 scales [N]); ``amax`` [N] overrides the rows' own
    (a row-parallel shard passes the full rows', reduced over its TP group)."""
    if amax is None:
        amax = w.abs().amax(dim=1)
    scale = amax_scale(amax)
    return _to_fp8(w, scale[:, None]), scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], float32 scales [M, 1]): dynamic per-token activations."""
    scale = amax_scale(x.abs().amax(dim=-1, keepdim=True))
    return _to_fp8(x, scale), scale


def quantize_per_token_group(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], float32 scales [M, ceil(K / group)]); a ragged last group is
    scaled by its own elements."""
    M, K = x.shape
    G = -(-K // group)
    padded = F.pad(x.float(), (0, G * group - K)).view(M, G, group)
    scale = amax_scale(padded.abs().amax(dim=-1))
    q = _to_fp8(padded, scale[..., None]).view(M, G * group)[:, :K]
    return q, scale


def quantize_static(x: torch.Tensor, input_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] with a calibrated per-tensor scale [1] -> (fp8, scales [M, 1])."""
    scale = input_scale.float().view(1, 1).expand(x.shape[0], 1)
    return _to_fp8(x, scale), scale


def expand_blocks(scale: torch.Tensor, rows: int, cols: int, block=(GROUP, GROUP)) -> torch.Tensor:
    """Block scales [ceil(rows / bn), ceil(cols / bk)] as one value per element [rows, cols]."""
    return scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def dequantize_weight(w: torch.Tensor, scale: torch.Tensor, scheme: Fp8Config) -> torch.Tensor:
    """float32 [N, K] of an fp8 weight and its scales (per row [N], or blocks)."""
    if scheme.weight_strategy == "block":
        return w.float() * expand_blocks(scale.float(), *w.shape, scheme.weight_block_size)
    return w.float() * scale.float().view(-1, 1)


def quantize_activation(x: torch.Tensor, scheme: Fp8Config, input_scale: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    if scheme.activation_scheme == "static":
        return quantize_static(x, input_scale)
    if scheme.activation_strategy == "group":
        return quantize_per_token_group(x, scheme.group_size)
    return quantize_per_token(x)


def dequantize_activation(q: torch.Tensor, scale: torch.Tensor, group: int | None = None) -> torch.Tensor:
    if group is None:
        return q.float() * scale
    return q.float() * scale.repeat_interleave(group, 1)[:, :q.shape[1]]


# -- loading: online quantization of a full-precision shard ---------------------------------------
def online_quantize(w: torch.Tensor, tp=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A loaded full-precision shard [N, K] -> (fp8, per-row scales [N]).  ``tp`` (a TPGroup)
    for a row-parallel shard: each rank holds part of every row, and the scale must be the full
    row's, so the ranks agree on it (and TP=2 quantizes the weights exactly as TP=1)."""
    amax = w.abs().amax(dim=1).float()
    if tp is not None and tp.size > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=tp.group)
    return quantize_per_row(w, amax)


# -- forward ---------------------------------------------------------------------------------------
def wants_quantized_input(x: torch.Tensor, weight: torch.Tensor, scheme: Fp8Config | None) -> bool:
    """Whether the kernel before this linear should hand it x quantized: dynamic per-token
    activations into a path that runs on their codes (``skinny``, ``scaled_mm``)."""
    # Online quantization only, for now: on the H200 the compressed-tensors gate row (dynamic
    # per-token, channel weights) fell from 83.1% to 80.5% agreement with the fusion on, below its
    # bar, while the online row passes with it (86.7%) and its codes are checked exact in the GPU
    # model test; why the serialized checkpoint differs is not yet known.
    return (FUSED_QUANT and scheme is not None and not scheme.is_checkpoint_fp8_serialized
            and weight.dtype == FP8_DTYPE and scheme.activation_scheme == "dynamic"
            and scheme.activation_strategy != "group" and scheme.weight_strategy != "block"
            and select_fp8_kernel(x.reshape(-1, x.shape[-1]), weight, scheme) in ("skinny", "scaled_mm"))


def select_fp8_kernel(x: torch.Tensor, weight: torch.Tensor, scheme: Fp8Config) -> str:
    """The path ``apply_fp8_linear`` runs for x [M, K] and this weight (see the module doc)."""
    M, K = x.shape
    N = weight.shape[0]
    block = scheme.weight_strategy == "block"
    gpu = x.is_cuda and available()
    if not gpu:
        return "dequant"
    gemv_row = M <= gemv.MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16)  # what w8a16 can take
    if FORCE != "auto":
        allowed = {"dequant"} | ({"block_triton", "block_dequant"} if block else {"scaled_mm", "skinny"})
        if not block and gemv_row:
            allowed.add("w8a16")  # weight-only, one row: issue 39's candidate, forced to measure it
        if FORCE in allowed and (FORCE != "scaled_mm" or _scaled_mm_ok(x, N, K)):
            return FORCE
    if block:
        return "block_triton" if x.dtype in (torch.bfloat16, torch.float16) else "block_dequant"
    if gemv_row and scheme.activation_scheme == "dynamic" and kernel_configs.tuned("w8a16", M, N, K, x.device):
        return "w8a16"  # this GPU's table holds it for the shape: it beat the skinny kernel there
    if M <= SKINNY_MAX_M and x.dtype in (torch.bfloat16, torch.float16):
        return "skinny"
    return "scaled_mm" if _scaled_mm_ok(x, N, K) else "dequant"


def _scaled_mm_ok(x: torch.Tensor, N: int, K: int) -> bool:
    # cuBLASLt's FP8 GEMM wants 16-aligned K and N; row-wise scales want a bf16 output.
    return x.dtype == torch.bfloat16 and K % 16 == 0 and N % 16 == 0


def _quantized_rows(x: torch.Tensor, scheme: Fp8Config, input_scale) -> tuple[torch.Tensor, torch.Tensor]:
    """x's e4m3 codes and per-row scales [M, 1] (contiguous) for the per-channel GEMMs: the Triton
    quantizer for dynamic per-token scales on CUDA (one kernel, the reference's codes), torch's
    reference otherwise (a static scale, or Triton's CPU interpreter)."""
    if scheme.activation_scheme == "dynamic" and x.is_cuda and available():
        return quantize_per_token_triton(x)
    xq, xs = quantize_activation(x.contiguous(), scheme, input_scale)
    return xq, xs.contiguous()


def apply_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, scheme: Fp8Config,
                     input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                     kernel: str | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) for an fp8 weight [N, K]; x [..., K] in the model dtype (or a
    ``QuantizedActivation``, whose codes the per-token paths use), y in x's dtype.
    ``weight_scale``: [N] float32, or [ceil(N/128), ceil(K/128)] for block weights.
    ``kernel`` overrides ``select_fp8_kernel`` (tests)."""
    pre = None
    if isinstance(x, QuantizedActivation):
        if scheme.activation_scheme != "dynamic" or scheme.activation_strategy == "group":
            raise ValueError(f"fp8 linear: a per-token quantized input does not fit the {scheme.activation_scheme} "
                             f"{scheme.activation_strategy} activation scheme")
        pre, x = (x.xq, x.xs), x.x
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"fp8 linear: x has {x.shape[1]} features, the weight {tuple(weight.shape)} expects "
                         f"{weight.shape[1]}")
    kernel = kernel or select_fp8_kernel(x, weight, scheme)
    if kernel == "dequant":
        xq, xs = pre if pre is not None else quantize_activation(x, scheme, input_scale)
        xd = dequantize_activation(xq, xs, scheme.group_size)
        y = F.linear(xd, dequantize_weight(weight, weight_scale, scheme)).to(x.dtype)
    elif kernel == "block_dequant":  # slower fallback: the weight dequantized to x's dtype every call
        xq, xs = quantize_activation(x, scheme, input_scale)
        xd = dequantize_activation(xq, xs, scheme.group_size).to(x.dtype)
        y = F.linear(xd, dequantize_weight(weight, weight_scale, scheme).to(x.dtype))
    elif kernel in ("scaled_mm", "skinny"):
        xq, xs = pre if pre is not None else _quantized_rows(x, scheme, input_scale)
        if kernel == "skinny":
            y = fp8_skinny(xq, xs, weight, weight_scale, x.dtype)
        else:
            y = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=weight_scale.view(1, -1), out_dtype=x.dtype)
    elif kernel == "w8a16":  # the e4m3 weight against x itself: no activation quantization
        if scheme.weight_strategy == "block" or not x.is_cuda:
            raise ValueError("fp8 linear: w8a16 takes per-channel weights on CUDA")
        y = gemv.gemv(x if x.stride(1) == 1 else x.contiguous(), weight, w_scale=weight_scale.float().contiguous())
    elif kernel == "block_triton":
        y = fp8_block_matmul(x, weight, weight_scale, scheme.group_size)
    else:
        raise ValueError(f"fp8 linear: unknown kernel {kernel!r}; one of {KERNELS[1:]}")
    if bias is not None:
        y = y + bias
    return y.view(*shape[:-1], weight.shape[0])
