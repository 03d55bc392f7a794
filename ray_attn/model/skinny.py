"""y = x W^T for a few rows (2-16: a step verifying k drafts at batch 1, small-batch decode) on
tensor cores, as one Triton kernel that streams W once.

Why: a speculative step at batch 1 is a query of 1 + k rows, so its linears leave the one-row
GEMV (``gemv.py``) for cuBLAS.  On an H100 that made the step's GEMMs 5.64 ms at 5 rows against
~4.6 ms of GEMV at one (Llama-3-8B shapes; ``scripts/bench_spec_verify.py --profile``): the verify
cost, 1.23x a plain step, was that GPU time, not the host's.  cuBLAS's small-M tiles split K for
the narrow projections (a reduce kernel each) and read the weights at 60-89% of the copy rate.
This kernel gives each program BLOCK_N rows of W, pads x to tl.dot's 16 rows, and streams W once
over K: at these sizes the rows cost nothing but registers, so 5 rows should read W as fast as
one.  Its tile and K loop (``skinny_tile``) are the FP8 skinny kernel's too (``fp8_kernels``).

Where it runs: only on (shape, rows) that this GPU's tuned table holds (``kernel_configs``,
written by ``scripts/tune_decode_gemv.py --kernels skinny --write`` only where it beat cuBLAS);
every other shape, a device without a table, CPU and batch-invariant mode keep ``F.linear``.
"""

from __future__ import annotations

import os

import torch

from ray_attn.backend import batch_invariant, pdl
from ray_attn.backend.triton_ops import available
from ray_attn.model import kernel_configs

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - CPU machines without triton
    triton = None

MIN_ROWS, MAX_ROWS = 2, 16  # one row is the GEMV's; past 16 the tile's rows would double
# RAY_ATTN_SKINNY_SILU=1 has down_proj's skinny kernel make SiLU-mul itself (read at import).  Off
# by default: on an H200 (2026-12-07, bench_spec_verify.py --k 0 4) it made the verifying step
# 3.1x a plain one against 1.12x with SiLU-mul apart -- its gate and up tiles, made in registers
# before the dot, run the K loop ~10x slower than the plain kernel's.  Kept, opt-in, for a tile
# that suits it; RAY_ATTN_GEMV_SILU=0 turns off the one-row GEMV's fusion as well.
FUSE_SILU = os.environ.get("RAY_ATTN_SKINNY_SILU", "0") == "1"

if triton is not None:

    @triton.jit
    def silu_mul_rounded(g, u, dtype: tl.constexpr):
        """silu(g) * u in ``dtype``, rounded where ``fused.silu_mul``'s kernel rounds (silu, then
        the product), so a linear that makes it from gate and up itself reads that kernel's
        values to the bit: the GEMV's and the skinny kernel's fused down_proj."""
        g = g.to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        return (a * u.to(tl.float32)).to(dtype)

    @triton.jit
    def _x_tile(x_rows, kk, mask, K, SILU_MUL: tl.constexpr):
        """x's [BLOCK_M, BLOCK_K] tile at columns ``kk``; SILU_MUL: the rows hold gate then up
        (2K wide) and the tile is silu(gate) * up."""
        a = tl.load(x_rows + kk[None, :], mask=mask, other=0.0)
        if SILU_MUL:
            u = tl.load(x_rows + K + kk[None, :], mask=mask, other=0.0)
            a = silu_mul_rounded(a, u, x_rows.dtype.element_ty)
        return a

    @triton.jit
    def skinny_dot(x_rows, w_rows, mmask, nmask, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, PEEL: tl.constexpr, USE_PDL: tl.constexpr, SILU_MUL: tl.constexpr):
        """The float32 [BLOCK_M, BLOCK_N] product of x's rows (pointers ``x_rows`` [BLOCK_M, 1])
        and W's (``w_rows`` [1, BLOCK_N]) over K, in BLOCK_K steps on tensor cores: this kernel's
        and the FP8 skinny kernel's (``fp8_kernels``) shared loop.  PEEL: the first K step runs
        before the loop, its weight tile loaded before the wait for the kernel before (PDL,
        ``pdl.py``; weights are never written during a step) and x's after it; else the wait
        comes first.  SILU_MUL: x's rows are [gate | up] and the product is made per tile."""
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        start = 0
        if PEEL:
            b = tl.load(w_rows + rk[:, None], mask=nmask[None, :] & (rk < K)[:, None], other=0.0,
                        eviction_policy="evict_first")  # [BLOCK_K, BLOCK_N]
            if USE_PDL:
                tl.extra.cuda.gdc_wait()
            a = _x_tile(x_rows, rk, mmask[:, None] & (rk < K)[None, :], K, SILU_MUL)
            acc += tl.dot(a, b)
            start = BLOCK_K
        elif USE_PDL:
            tl.extra.cuda.gdc_wait()
        for k in range(start, K, BLOCK_K):
            kk = k + rk
            kmask = kk < K
            a = _x_tile(x_rows, kk, mmask[:, None] & kmask[None, :], K, SILU_MUL)
            b = tl.load(w_rows + kk[:, None], mask=nmask[None, :] & kmask[:, None], other=0.0,
                        eviction_policy="evict_first")
            acc += tl.dot(a, b)
        return acc

    @triton.jit
    def skinny_tile(x_ptr, w_ptr, M, N, K, x_stride, w_stride, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, PEEL: tl.constexpr, USE_PDL: tl.constexpr, SILU_MUL: tl.constexpr):
        """This program's output tile of a skinny kernel: (float32 x . W^T, its rows, its
        columns, their masks), the program ids read as (N tile, M tile)."""
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
        pid_n, pid_m = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mmask, nmask = rm < M, rn < N
        acc = skinny_dot(x_ptr + rm[:, None] * x_stride, w_ptr + rn[None, :].to(tl.int64) * w_stride, mmask, nmask,
                         K, BLOCK_M, BLOCK_N, BLOCK_K, PEEL, USE_PDL, SILU_MUL)
        return acc, rm, rn, mmask, nmask

    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, x_stride, w_stride, y_stride,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr, SILU_MUL: tl.constexpr):
        """y tile [BLOCK_M, BLOCK_N] = x . W^T (+ bias), float32 accumulation, the first K step
        peeled; SILU_MUL: x is [M, 2K], gate then up, and the tiles are silu(gate) * up."""
        acc, rm, rn, mmask, nmask = skinny_tile(x_ptr, w_ptr, M, N, K, x_stride, w_stride, BLOCK_M, BLOCK_N, BLOCK_K,
                                                True, USE_PDL, SILU_MUL)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * y_stride + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])


def config(m: int, n: int) -> dict:
    """An untuned starting point: 16-row tiles (tl.dot's least M), 32 weight rows a program
    (N = 4096 gives 128 programs), 64 for the wide shapes, 256-wide K steps four deep."""
    return dict(BLOCK_M=16, BLOCK_N=64 if n >= 16384 else 32, BLOCK_K=256, num_warps=4, num_stages=4)


def skinny(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
           **cfg) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T (+ bias) on CUDA (or Triton's interpreter) with the skinny kernel;
    ``cfg`` overrides the config (the tuned table's first).  ``silu_mul``: x is [M, 2K], gate
    then up, and the kernel makes silu(gate) * up itself (down_proj after a SwiGLU: one kernel,
    not two, as the one-row GEMV does).  Shapes and strides are checked here, on the host, and
    refused by name."""
    if triton is None:
        raise RuntimeError("skinny needs triton")
    k_in = (2 if silu_mul else 1) * w.shape[1] if w.dim() == 2 else -1  # x's width (-1: w is refused)
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != k_in or w.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"skinny: x {tuple(x.shape)} and w {tuple(w.shape)} must be 2-D, agree on K"
                         f"{' (x: gate and up, 2K)' if silu_mul else ''} and have unit stride along it")
    if x.dtype != w.dtype or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"skinny: x and w must both be bfloat16 or float16, got {x.dtype} and {w.dtype}")
    m, k = x.shape[0], w.shape[1]
    n = w.shape[0]
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype or not bias.is_contiguous()):
        raise ValueError(f"skinny: bias must be a contiguous [{n}] {x.dtype} tensor, got {tuple(bias.shape)} "
                         f"{bias.dtype}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    c = {**config(m, n), **kernel_configs.tuned("skinny", m, n, k, x.device), **cfg}
    if silu_mul:
        c["num_stages"] = fit_stages(c, x.element_size(), 2, x.device)
    grid = (triton.cdiv(n, c["BLOCK_N"]), triton.cdiv(m, c["BLOCK_M"]))
    _skinny_kernel[grid](x, w, bias if bias is not None else w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
                         HAS_BIAS=bias is not None, SILU_MUL=silu_mul, **pdl.launch(x.device), **c)
    return y


def half_rows_on_cuda(x: torch.Tensor, w: torch.Tensor, min_rows: int, max_rows: int) -> bool:
    """What our half-precision decode kernels (this one, ``gemv.py``'s) take: x [min_rows..max_rows,
    K] on CUDA with Triton, bf16/fp16 like w, w unit-stride along K, and not batch-invariant mode
    (their sums would differ from the same row in a batch)."""
    return (available() and x.is_cuda and x.dim() == 2 and min_rows <= x.shape[0] <= max_rows
            and not batch_invariant.enabled()
            and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype and w.stride(1) == 1)


def fit_stages(c: dict, elem: int, x_tiles: int, device: torch.device) -> int:
    """``c``'s pipeline depth, cut to what this GPU's shared memory holds when a K step loads
    ``x_tiles`` tiles of x (gate and up: 2) beside W's.  Triton buffers num_stages - 1 K steps
    of both operands: the down_proj shape's tuned (BLOCK_N 32, BLOCK_K 512, 5 stages) needs
    4 x 64 KB with two x tiles, over an H100's 227 KB, where one x tile's 4 x 48 KB fit."""
    per_step = c["BLOCK_K"] * (x_tiles * c["BLOCK_M"] + c["BLOCK_N"]) * elem
    limit = _smem_limit(device)
    if limit is None:
        return c["num_stages"]
    return max(1, min(c["num_stages"], 1 + limit // per_step))


def _smem_limit(device: torch.device) -> int | None:
    """Shared memory a block may opt into on ``device`` (None off CUDA: the interpreter has none)."""
    if device.type != "cuda":
        return None
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", None)


def use_skinny(x: torch.Tensor, w: torch.Tensor) -> bool:
    """2-16 rows on CUDA in bf16/fp16, on a weight shape this GPU's tuned table holds for that
    many rows (the tune writes one only where the kernel beat cuBLAS there)."""
    return (half_rows_on_cuda(x, w, MIN_ROWS, MAX_ROWS)
            and bool(kernel_configs.tuned("skinny", x.shape[0], w.shape[0], w.shape[1], x.device)))
