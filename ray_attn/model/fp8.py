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
- CUDA, per-row weight scales: ``torch._scaled_mm`` (row-wise scales [M, 1] and [1, N], e4m3
  operands, the weight column-major) above ``GEMV_MAX_M`` rows; at decode sizes a Triton GEMV
  (``_fp8_gemv_kernel``) that reads the fp8 weight bytes once and quantizes the activation rows
  itself, so one kernel serves the layer.
- CUDA, block weights: a Triton kernel (``_fp8_block_kernel``) whose K step is one 128-group, so
  it quantizes each group of x as it loads it and applies both block scales to that step's
  partial product; ``block_dequant`` (dequantize the weight, bf16 matmul) is the slower fallback.

Activations are quantized on every path, decode included: a W8A16 GEMV would be more accurate,
but then a token's logits would depend on whether its step ran the GEMV or the GEMM.
``select_fp8_kernel`` is the one place that picks a path (``RAY_ATTN_FP8_KERNEL`` forces one, for
measurements).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ray_attn.backend.triton_ops import available
from ray_attn.model.quantization import FP8_E4M3_MAX, Fp8Config

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - CPU machines without triton
    triton = None

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = FP8_E4M3_MAX
# vLLM's MIN_SCALING_FACTOR: an all-zero (or tiny) row gets a finite scale, never 0 / 0.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
GROUP = 128  # activation group (= weight block) of the block-wise format
# Rows up to which the Triton GEMV serves per-row-scaled weights (decode); tune on the GPU.
GEMV_MAX_M = 16
KERNELS = ("auto", "dequant", "scaled_mm", "gemv", "block_triton", "block_dequant")
# RAY_ATTN_FP8_KERNEL forces a path where it can run (an A/B switch for benchmarks; read at import,
# and ``fp8.FORCE`` may be set by a script).
FORCE = os.environ.get("RAY_ATTN_FP8_KERNEL", "auto")
if FORCE not in KERNELS:
    raise ValueError(f"RAY_ATTN_FP8_KERNEL={FORCE!r} is not one of {KERNELS}")


# -- quantize / dequantize (torch; the reference every kernel is held to) ------------------------
def _to_fp8(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # Division, not a multiply by 1 / scale: the kernels divide too (IEEE-rounded), so the same
    # value rounds to the same e4m3 code everywhere.
    return (t.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def amax_scale(amax: torch.Tensor) -> torch.Tensor:
    return (amax.float() / FP8_MAX).clamp_(min=MIN_SCALE)


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
def select_fp8_kernel(x: torch.Tensor, weight: torch.Tensor, scheme: Fp8Config) -> str:
    """The path ``apply_fp8_linear`` runs for x [M, K] and this weight (see the module doc)."""
    M, K = x.shape
    N = weight.shape[0]
    block = scheme.weight_strategy == "block"
    gpu = x.is_cuda and available()
    if not gpu:
        return "dequant"
    if FORCE != "auto":
        allowed = {"dequant"} | ({"block_triton", "block_dequant"} if block else {"scaled_mm", "gemv"})
        if FORCE in allowed and (FORCE != "scaled_mm" or _scaled_mm_ok(x, N, K)):
            return FORCE
    if block:
        return "block_triton" if x.dtype in (torch.bfloat16, torch.float16) else "block_dequant"
    if M <= GEMV_MAX_M:
        return "gemv"
    return "scaled_mm" if _scaled_mm_ok(x, N, K) else "dequant"


def _scaled_mm_ok(x: torch.Tensor, N: int, K: int) -> bool:
    # cuBLASLt's FP8 GEMM wants 16-aligned K and N; row-wise scales want a bf16 output.
    return x.dtype == torch.bfloat16 and K % 16 == 0 and N % 16 == 0


def apply_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, scheme: Fp8Config,
                     input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                     kernel: str | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) for an fp8 weight [N, K]; x [..., K] in the model dtype, y in x's dtype.
    ``weight_scale``: [N] float32, or [ceil(N/128), ceil(K/128)] for block weights.
    ``kernel`` overrides ``select_fp8_kernel`` (tests)."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"fp8 linear: x has {x.shape[1]} features, the weight {tuple(weight.shape)} expects "
                         f"{weight.shape[1]}")
    kernel = kernel or select_fp8_kernel(x, weight, scheme)
    if kernel == "dequant":
        xq, xs = quantize_activation(x, scheme, input_scale)
        xd = dequantize_activation(xq, xs, scheme.group_size)
        y = F.linear(xd, dequantize_weight(weight, weight_scale, scheme)).to(x.dtype)
    elif kernel == "block_dequant":  # slower fallback: the weight dequantized to x's dtype every call
        xq, xs = quantize_activation(x, scheme, input_scale)
        xd = dequantize_activation(xq, xs, scheme.group_size).to(x.dtype)
        y = F.linear(xd, dequantize_weight(weight, weight_scale, scheme).to(x.dtype))
    elif kernel == "scaled_mm":
        xq, xs = quantize_activation(x.contiguous(), scheme, input_scale)
        y = torch._scaled_mm(xq, weight.t(), scale_a=xs.contiguous(), scale_b=weight_scale.view(1, -1),
                             out_dtype=x.dtype)
    elif kernel == "gemv":
        y = fp8_gemv(x, weight, weight_scale, input_scale if scheme.activation_scheme == "static" else None)
    elif kernel == "block_triton":
        y = fp8_block_matmul(x, weight, weight_scale, scheme.group_size)
    else:
        raise ValueError(f"fp8 linear: unknown kernel {kernel!r}; one of {KERNELS[1:]}")
    if bias is not None:
        y = y + bias
    return y.view(*shape[:-1], weight.shape[0])


# -- Triton kernels (CUDA; also run on CPU under TRITON_INTERPRET=1, which is how CI checks them) --
# Triton's CPU interpreter rounds float32 -> e4m3 wrongly when rounding carries into the next
# binade (127.8 becomes 64, not 128); under it the kernels round on the e4m3 grid themselves
# first, so the cast is exact.  On GPUs the hardware conversion rounds correctly and this is off.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

if triton is not None:

    @triton.jit
    def _round_e4m3(q):
        a = tl.abs(q)
        step = tl.exp2(tl.maximum(tl.floor(tl.log2(tl.maximum(a, 1e-30))), -6.0) - 3.0)  # 3 mantissa bits; subnormals below 2^-6
        t = a / step  # exact: a power-of-two scaling
        f = tl.floor(t)
        d = t - f
        odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
        r = f + tl.where((d > 0.5) | ((d == 0.5) & odd), 1.0, 0.0)
        return tl.where(q < 0, -r * step, r * step)

    @triton.jit
    def _quantize(x, scale, INTERPRET: tl.constexpr):
        # As _to_fp8: an IEEE-rounded division, clamp, round to nearest even.
        q = tl.math.div_rn(x, scale)
        q = tl.minimum(tl.maximum(q, -448.0), 448.0)
        if INTERPRET:
            q = tl.where(q == 0.0, q, _round_e4m3(q))
        return q.to(tl.float8e4nv)

    @triton.jit
    def _fp8_gemv_kernel(x_ptr, w_ptr, ws_ptr, is_ptr, y_ptr, M, N, K, x_stride, w_stride, y_stride,
                         STATIC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
        """Each program: BLOCK_N rows of the fp8 weight, streamed once over K, against all M
        rows of x, which it quantizes itself (a first pass over x for the per-token scales; x
        is small and L2-resident at decode sizes, the weight is what the kernel is bound by)."""
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        nmask, mmask = rn < N, rm < M
        if STATIC:
            sx = tl.zeros((BLOCK_M,), dtype=tl.float32) + tl.load(is_ptr)
        else:
            amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for k in range(0, K, BLOCK_K):
                kmask = (k + rk) < K
                x = tl.load(x_ptr + rm[:, None] * x_stride + (k + rk)[None, :],
                            mask=mmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
            sx = tl.maximum(tl.math.div_rn(amax, 448.0), 1.0 / (448.0 * 512.0))
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            kmask = (k + rk) < K
            x = tl.load(x_ptr + rm[:, None] * x_stride + (k + rk)[None, :],
                        mask=mmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
            xq = _quantize(x, sx[:, None], INTERPRET).to(tl.float32)
            w = tl.load(w_ptr + rn[:, None].to(tl.int64) * w_stride + (k + rk)[None, :],
                        mask=nmask[:, None] & kmask[None, :], other=0.0, eviction_policy="evict_first")
            acc += xq[:, None, :] * w.to(tl.float32)[None, :, :]
        sw = tl.load(ws_ptr + rn, mask=nmask, other=0.0)
        y = tl.sum(acc, axis=2) * sx[:, None] * sw[None, :]
        tl.store(y_ptr + rm[:, None] * y_stride + rn[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])

    @triton.jit
    def _fp8_block_kernel(x_ptr, w_ptr, ws_ptr, y_ptr, M, N, K, x_stride, w_stride, ws_stride, y_stride,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_K: tl.constexpr,
                          INTERPRET: tl.constexpr):
        """y tile [BLOCK_M, BLOCK_N] (BLOCK_N <= 128 and dividing it, so a tile's rows share one
        weight block row); each K step is one activation group: quantize it (per row scale of
        that group), dot with the weight tile in fp8, scale by both block scales, accumulate."""
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, GROUP_K)
        mmask, nmask = rm < M, rn < N
        nb = (pid_n * BLOCK_N) // 128
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for g in range(0, tl.cdiv(K, GROUP_K)):
            kk = g * GROUP_K + rk
            kmask = kk < K
            x = tl.load(x_ptr + rm[:, None] * x_stride + kk[None, :], mask=mmask[:, None] & kmask[None, :],
                        other=0.0).to(tl.float32)
            sx = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=1), 448.0), 1.0 / (448.0 * 512.0))
            xq = _quantize(x, sx[:, None], INTERPRET)
            w = tl.load(w_ptr + rn[None, :].to(tl.int64) * w_stride + kk[:, None],
                        mask=nmask[None, :] & kmask[:, None], other=0.0)  # [GROUP_K, BLOCK_N]
            sw = tl.load(ws_ptr + nb * ws_stride + g)
            acc += tl.dot(xq, w) * (sx[:, None] * sw)
        tl.store(y_ptr + rm[:, None] * y_stride + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])


def gemv_config(m: int) -> dict:
    """Block sizes for the GEMV: 8 weight rows per program and 1024-wide K steps at one row (8 KB
    of fp8 weights per step); narrower K steps for more rows keep the float32 partial sums
    (BLOCK_M x BLOCK_N x BLOCK_K) in registers.  Untuned: a starting point for the H200."""
    block_m = triton.next_power_of_2(max(m, 1))
    block_k = 1024 if block_m == 1 else 256 if block_m <= 2 else 128 if block_m <= 4 else 32
    return dict(BLOCK_M=block_m, BLOCK_N=8, BLOCK_K=block_k, num_warps=4, num_stages=3)


def block_config(m: int) -> dict:
    """Untuned starting point: 16-row tiles for decode (tl.dot's least M), 64 from prefill sizes."""
    return dict(BLOCK_M=16 if m <= 16 else 32 if m <= 64 else 64, BLOCK_N=128, num_warps=4, num_stages=3)


def _check_2d(name: str, x: torch.Tensor, w: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError(f"{name} needs triton")
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or w.stride(1) != 1 or w.dtype != FP8_DTYPE:
        raise ValueError(f"{name}: x {tuple(x.shape)} and an fp8 weight [N, K] with unit stride must agree on K, "
                         f"got weight {tuple(w.shape)} {w.dtype}")


def fp8_gemv(x: torch.Tensor, w: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None = None,
             **cfg) -> torch.Tensor:
    """x [M, K] (model dtype) @ fp8 w [N, K]^T with per-row scales [N] float32: the Triton GEMV,
    quantizing x per token (or by the static ``input_scale``) inside the kernel."""
    _check_2d("fp8_gemv", x, w)
    x = x if x.stride(1) == 1 else x.contiguous()
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    c = {**gemv_config(M), **cfg}
    grid = (triton.cdiv(N, c["BLOCK_N"]),)
    _fp8_gemv_kernel[grid](x, w, weight_scale, input_scale if input_scale is not None else weight_scale, y,
                           M, N, K, x.stride(0), w.stride(0), y.stride(0), STATIC=input_scale is not None,
                           INTERPRET=INTERPRET, **c)
    return y


def fp8_block_matmul(x: torch.Tensor, w: torch.Tensor, weight_scale: torch.Tensor, group: int = GROUP,
                     **cfg) -> torch.Tensor:
    """x [M, K] (model dtype) @ fp8 w [N, K]^T with block scales [ceil(N/128), ceil(K/128)]:
    the Triton block kernel, x quantized per token and group of 128 as it is read."""
    _check_2d("fp8_block_matmul", x, w)
    x = x if x.stride(1) == 1 else x.contiguous()
    M, K = x.shape
    N = w.shape[0]
    if group != GROUP or weight_scale.shape != (-(-N // 128), -(-K // 128)):
        raise ValueError(f"fp8_block_matmul: block scales {tuple(weight_scale.shape)} do not fit a [{N}, {K}] "
                         f"weight in 128 x 128 blocks")
    weight_scale = weight_scale.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    c = {**block_config(M), **cfg}
    if 128 % c["BLOCK_N"]:
        raise ValueError(f"fp8_block_matmul: BLOCK_N={c['BLOCK_N']} must divide 128")
    grid = (triton.cdiv(M, c["BLOCK_M"]), triton.cdiv(N, c["BLOCK_N"]))
    _fp8_block_kernel[grid](x, w, weight_scale, y, M, N, K, x.stride(0), w.stride(0), weight_scale.stride(0),
                            y.stride(0), GROUP_K=group, INTERPRET=INTERPRET, **c)
    return y
