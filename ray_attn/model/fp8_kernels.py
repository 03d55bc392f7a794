"""The Triton kernels of the FP8 linear layers (see ``fp8.py`` for the math they compute and the
dispatch that picks one), and their launchers.  CUDA; CI runs them on CPU under Triton's
interpreter (``TRITON_INTERPRET=1``).

- ``quantize_per_token_triton``: one kernel that gives each row of x its e4m3 codes and scale
  (``max |x| / 448``) -- in front of ``torch._scaled_mm`` and the skinny kernel.  The same IEEE
  division as the torch reference on CPU, so the codes are the reference's; torch's own CUDA ops
  for it took 8 kernels (~20 us in a decode graph) and rounded some scales differently.
- ``fp8_skinny``: decode sizes (a few rows), per-channel weights: tensor-core dots of the
  quantized rows against BLOCK_N weight rows per program, the weight streamed once.  It replaced
  a CUDA-core GEMV that converted every weight byte to float32 (1.1-2x slower from one row,
  10-40x from eight: ``benchmarks/results/bench_fp8.json``).
- ``fp8_block_matmul``: 128 x 128 block weights, x quantized per token and group as it is read.
"""

from __future__ import annotations

import os

import torch

from ray_attn.backend import pdl
from ray_attn.model import kernel_configs
from ray_attn.model.quantization import FP8_E4M3_MAX

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - CPU machines without triton
    triton = None

FP8_DTYPE = torch.float8_e4m3fn
GROUP = 128  # activation group (= weight block) of the block-wise format
MIN_SCALE = 1.0 / (FP8_E4M3_MAX * 512.0)  # vLLM's MIN_SCALING_FACTOR

# Triton's CPU interpreter rounds float32 -> e4m3 wrongly when rounding carries into the next
# binade (127.8 becomes 64, not 128); under it the kernels round on the e4m3 grid themselves
# first, so the cast is exact.  On GPUs the hardware conversion rounds correctly and this is off.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

if triton is not None:
    from ray_attn.model.skinny import skinny_tile  # the skinny kernels' shared tile and K loop

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


    @triton.jit
    def _quant_per_token_kernel(x_ptr, q_ptr, s_ptr, K, x_stride, q_stride, BLOCK_K: tl.constexpr,
                                INTERPRET: tl.constexpr, USE_PDL: tl.constexpr):
        """One program per row: max |x| over K, then the codes of x / (max / 448)."""
        if USE_PDL:  # pdl.py: nothing an earlier kernel writes is read before the wait
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        row = tl.program_id(0).to(tl.int64)
        rk = tl.arange(0, BLOCK_K)
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + row * x_stride + k + rk, mask=(k + rk) < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        sx = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), 448.0), 1.0 / (448.0 * 512.0))
        for k in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + row * x_stride + k + rk, mask=(k + rk) < K, other=0.0).to(tl.float32)
            tl.store(q_ptr + row * q_stride + k + rk, _quantize(x, sx, INTERPRET), mask=(k + rk) < K)
        tl.store(s_ptr + row, sx)

    @triton.jit
    def _fp8_skinny_kernel(xq_ptr, sx_ptr, w_ptr, ws_ptr, y_ptr, M, N, K, x_stride, w_stride, y_stride,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           PEEL: tl.constexpr, USE_PDL: tl.constexpr):
        """y tile [BLOCK_M, BLOCK_N] = (codes of x) . (codes of W)^T on tensor cores, then both
        scales: few rows (decode), so the weight tile is what each K step waits for.  x arrives
        quantized: a variant that quantized it here (a pass over x for its max, then bf16 tiles
        converted in registers before each dot) ran 6-10x slower at one row on the H200.
        The tile and its K loop (PEEL included) are ``skinny.skinny_tile``'s, shared with the bf16 kernel."""
        acc, rm, rn, mmask, nmask = skinny_tile(xq_ptr, w_ptr, M, N, K, x_stride, w_stride, BLOCK_M, BLOCK_N, BLOCK_K,
                                                PEEL, USE_PDL, False)
        sx = tl.load(sx_ptr + rm, mask=mmask, other=0.0)
        sw = tl.load(ws_ptr + rn, mask=nmask, other=0.0)
        y = acc * sx[:, None] * sw[None, :]
        tl.store(y_ptr + rm[:, None] * y_stride + rn[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])


def quantize_per_token_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 codes [M, K], float32 scales [M, 1]), as ``fp8.quantize_per_token``."""
    if triton is None:
        raise RuntimeError("quantize_per_token_triton needs triton")
    x = x if x.stride(1) == 1 else x.contiguous()
    M, K = x.shape
    q = torch.empty(M, K, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    block_k = min(4096, triton.next_power_of_2(K))
    _quant_per_token_kernel[(M,)](x, q, s, K, x.stride(0), q.stride(0), BLOCK_K=block_k, INTERPRET=INTERPRET,
                                  num_warps=4 if block_k <= 1024 else 8, **pdl.launch(x.device))
    return q, s


# RAY_ATTN_SKINNY_PEEL=0: the skinny kernel waits for the kernel before first, instead of loading
# its first weight tile before the wait (an A/B switch, read at import; NOTES.md 2026-12-06 has why).
SKINNY_PEEL = os.environ.get("RAY_ATTN_SKINNY_PEEL", "1") != "0"
SMEM_BUDGET = 200 * 1024  # of the H100/H200's 227 KiB per block, for the pipelined tiles


def skinny_config(m: int, n: int) -> dict:
    """From scripts/bench_fp8.py's sweep on the H200 (Llama-3-8B shapes, 1-64 rows): 16-row tiles
    (tl.dot's least M), 512-wide K steps five deep (256 from 32 rows); 64 weight rows per program
    for qkv-sized N (6144), 32 elsewhere (N = 4096 then still gives 128 programs); gate_up-sized
    N (28672) liked 256-wide steps three deep.  The stages are capped so that the tiles in flight
    fit shared memory.  A device's tuned table (``kernel_configs.py``, ``scripts/tune_decode_gemv.py``)
    overrides these per weight shape."""
    wide = n >= 16384
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n, block_k = (64 if 4096 < n < 16384 else 32), (256 if wide or block_m > 16 else 512)
    stage = block_m * block_k + block_k * block_n
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
                num_stages=max(2, min(3 if wide else 5, SMEM_BUDGET // stage)))


def fp8_skinny(xq: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, weight_scale: torch.Tensor,
               out_dtype: torch.dtype, **cfg) -> torch.Tensor:
    """Quantized rows xq [M, K] (e4m3) with their scales sx [M, 1] @ fp8 w [N, K]^T with per-row
    scales [N] float32, as ``out_dtype``: the skinny kernel.  ``fp8.apply_fp8_linear`` quantizes
    the rows (the same codes as for ``_scaled_mm``)."""
    _check_2d("fp8_skinny", xq, w)
    xq, sx = (t if t.is_contiguous() else t.contiguous() for t in (xq, sx))
    M, K = xq.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    c = {**skinny_config(M, N), **kernel_configs.tuned("fp8_skinny", M, N, K, xq.device), **cfg}
    grid = (triton.cdiv(N, c["BLOCK_N"]), triton.cdiv(M, c["BLOCK_M"]))
    _fp8_skinny_kernel[grid](xq, sx, w, weight_scale, y, M, N, K, xq.stride(0), w.stride(0), y.stride(0),
                             PEEL=SKINNY_PEEL, **pdl.launch(xq.device), **c)
    return y


def block_config(m: int) -> dict:
    """Untuned starting point: 16-row tiles for decode (tl.dot's least M), 64 from prefill sizes."""
    return dict(BLOCK_M=16 if m <= 16 else 32 if m <= 64 else 64, BLOCK_N=128, num_warps=4, num_stages=3)


def _check_2d(name: str, x: torch.Tensor, w: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError(f"{name} needs triton")
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or w.stride(1) != 1 or w.dtype != FP8_DTYPE:
        raise ValueError(f"{name}: x {tuple(x.shape)} and an fp8 weight [N, K] with unit stride must agree on K, "
                         f"got weight {tuple(w.shape)} {w.dtype}")


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
