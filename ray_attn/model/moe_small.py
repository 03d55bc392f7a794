"""The experts of a MoE layer for a few tokens (decode), as two Triton GEMV kernels.

Why: at one token a Qwen3-30B-A3B layer reads 8 experts (18 us at the H200's copy rate), but the
grouped GEMM (``fused_moe_grouped``) spends 86 us on it -- the fixed cost of 128 expert groups and
of the sort, gather and scatter around it (README, "MoE").  With a handful of (token, expert)
pairs there is nothing to group: each pair is a GEMV over its expert's weights, and a GEMV is a
stream of weight reads (``gemv.py``).  So:

- ``_gate_up_kernel``: program (n-tile, pair) reads BLOCK_N gate rows and the matching up rows of
  the pair's expert, dots them with the pair's token, and stores SiLU(gate) * up: the gate_up GEMM
  and the activation in one pass, no sort (the pair's expert id is read on the device);
- ``_down_kernel``: program (h-tile, token) runs the down projection of all of the token's k
  pairs at once (the experts are an axis of its tile) and sums them weighted by their routing
  weights: the down GEMM and ``_combine`` in one.

Two launches per layer, shapes fixed by (tokens, top_k), no host sync: CUDA-graph safe.  Each
pair's weights are read once per pair, so a token count where pairs share experts (prefill,
large batches) belongs to the grouped GEMM; ``SMALL_MAX_TOKENS`` is where ``FusedMoE`` switches.

The arithmetic rounds where the torch path rounds -- each projection's output to the model dtype,
SiLU before the product, a Llama 4 input scaled in the model dtype, the k outputs summed in
float32 -- so it matches ``fused_moe_loop`` to the rounding of float32 dot products.
"""

from __future__ import annotations

import torch

from ray_attn.backend.triton_ops import available
from ray_attn.backend import pdl

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - CPU machines without triton
    triton = None

# Tokens up to which FusedMoE's "auto" runs these kernels on CUDA: measured on the H200 against the
# grouped GEMM in CUDA graphs (``scripts/bench_moe.py``), one sparse layer took 32.5 vs 85.9 us at 1
# token and 164 vs 247 us at 8 (Qwen3-30B-A3B shapes; 485 vs 707 us for Llama-4-Scout's) -- ahead at
# every count measured, 8 the largest.  "small" forces them.
SMALL_MAX_TOKENS = 8
# The tiles, from ``scripts/tune_moe_small.py`` on the H100 (README, "MoE"): gate_up reads BLOCK_N=16
# rows of gate and of up a program; the down kernel 2 rows of each of the token's k experts, in a
# float32 accumulator of DOWN_TILE = k x BLOCK_N x BLOCK_K elements (Qwen3-30B-A3B's 8 experts:
# BLOCK_K 256; Llama 4's one: 2048).  At one token a Qwen3-30B-A3B layer's experts took 35.8 us at
# (8, 8, 8192) and 29.8 at these; Scout's 93.2 and 85.4.
BLOCK_N = 16
DOWN_BLOCK_N = 2
DOWN_TILE = 4096

if triton is not None:

    @triton.jit
    def _gate_up_kernel(x_ptr, w_ptr, ids_ptr, wts_ptr, a_ptr, N, K, x_stride, w_e_stride, w_n_stride,
                        a_stride, TOPK: tl.constexpr, SCALE_INPUT: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr):
        if USE_PDL:  # pdl.py: nothing an earlier kernel writes is read before the wait
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        pid, p = tl.program_id(0), tl.program_id(1).to(tl.int64)
        t = p // TOPK
        e = tl.load(ids_ptr + p).to(tl.int64)
        dt = a_ptr.dtype.element_ty
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        nmask = rn < N
        g_ptrs = w_ptr + e * w_e_stride + rn[:, None].to(tl.int64) * w_n_stride + rk[None, :]
        u_ptrs = g_ptrs + N * w_n_stride  # the up rows follow the gate rows
        x_ptrs = x_ptr + t * x_stride + rk
        if SCALE_INPUT:  # Llama 4: the expert's input times its weight, in the model dtype
            s = tl.load(wts_ptr + p).to(dt).to(tl.float32)
        # Partial products stay per K lane until the end: one reduction per row, not per step.
        acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            if EVEN_K:
                wmask = nmask[:, None]
                x = tl.load(x_ptrs).to(tl.float32)
            else:
                kmask = (k + rk) < K
                wmask = nmask[:, None] & kmask[None, :]
                x = tl.load(x_ptrs, mask=kmask, other=0.0).to(tl.float32)
            if SCALE_INPUT:
                x = (x * s).to(dt).to(tl.float32)
            g = tl.load(g_ptrs, mask=wmask, other=0.0, eviction_policy="evict_first")
            u = tl.load(u_ptrs, mask=wmask, other=0.0, eviction_policy="evict_first")
            acc_g += g.to(tl.float32) * x[None, :]
            acc_u += u.to(tl.float32) * x[None, :]
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        # rounded as the GEMM's output would be, then SiLU rounded before the product (fused.py)
        g = tl.sum(acc_g, axis=1).to(dt).to(tl.float32)
        u = tl.sum(acc_u, axis=1).to(dt).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(a_ptr + p * a_stride + rn, (act * u).to(dt), mask=nmask)

    @triton.jit
    def _down_kernel(a_ptr, w_ptr, ids_ptr, wts_ptr, y_ptr, N, K, a_stride, w_e_stride, w_n_stride,
                     y_stride, TOPK: tl.constexpr, TOPK_P2: tl.constexpr, WEIGHT_OUTPUT: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr):
        # The token's k experts are one axis of the tile, not a loop: each K step issues the loads of
        # all k weight tiles at once.  A loop over the experts waited out one memory round trip per
        # expert (K is short: Qwen3-30B-A3B's down reads 768 columns), ~1.7 TB/s on the H100.
        if USE_PDL:  # pdl.py: nothing an earlier kernel writes is read before the wait
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        pid, t = tl.program_id(0), tl.program_id(1).to(tl.int64)
        dt = y_ptr.dtype.element_ty
        rj = tl.arange(0, TOPK_P2)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        jmask = rj < TOPK
        nmask = rn < N
        p = t * TOPK + rj  # the token's pairs, in routing order
        e = tl.load(ids_ptr + p, mask=jmask, other=0).to(tl.int64)
        w_ptrs = (w_ptr + e[:, None, None] * w_e_stride + rn[None, :, None].to(tl.int64) * w_n_stride
                  + rk[None, None, :])
        a_ptrs = a_ptr + p[:, None] * a_stride + rk[None, :]
        wmask = jmask[:, None, None] & nmask[None, :, None]
        acc = tl.zeros((TOPK_P2, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs, mask=wmask, other=0.0, eviction_policy="evict_first")
                a = tl.load(a_ptrs, mask=jmask[:, None], other=0.0).to(tl.float32)
            else:
                kmask = (k + rk) < K
                w = tl.load(w_ptrs, mask=wmask & kmask[None, None, :], other=0.0, eviction_policy="evict_first")
                a = tl.load(a_ptrs, mask=jmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
            acc += w.to(tl.float32) * a[:, None, :]
            w_ptrs += BLOCK_K
            a_ptrs += BLOCK_K
        y = tl.sum(acc, axis=2).to(dt).to(tl.float32)  # each expert's output in the model dtype
        if WEIGHT_OUTPUT:
            y = y * tl.load(wts_ptr + p, mask=jmask, other=0.0).to(tl.float32)[:, None]
        total = tl.sum(y, axis=0)  # the k outputs summed in float32 (padded experts add zeros)
        tl.store(y_ptr + t * y_stride + rn, total.to(dt), mask=nmask)


def _block_k(k: int, cap: int) -> int:
    return min(cap, triton.next_power_of_2(max(k, 16)))


def small_supported(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Where the kernels can run: Triton, one dtype throughout, unit stride along K."""
    return (triton is not None and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and w13.dtype == x.dtype == w2.dtype and w13.stride(2) == 1 and w2.stride(2) == 1
            and x.device == w13.device == w2.device)


def use_small(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """FusedMoE "auto": these kernels on CUDA for up to SMALL_MAX_TOKENS tokens."""
    return available() and x.is_cuda and 0 < x.shape[0] <= SMALL_MAX_TOKENS and small_supported(x, w13, w2)


def fused_moe_small(x, w13, w2, topk_weights, topk_ids, apply_router_weight_on_input=False,
                    block_n: int = BLOCK_N, down_block_n: int = DOWN_BLOCK_N,
                    down_tile: int = DOWN_TILE) -> torch.Tensor:
    """``fused_moe_loop``'s function as two GEMV kernels over the (token, expert) pairs.

    ``w13`` [E, 2n, H] (gate rows, then up rows), ``w2`` [E, H, n]; ``topk_weights`` / ``topk_ids``
    [T, k].  ``block_n`` is the gate_up kernel's tile, ``down_block_n`` and ``down_tile`` the down
    kernel's (swept by ``scripts/tune_moe_small.py``).  On a machine without a GPU the
    kernels run only under ``TRITON_INTERPRET=1``."""
    if triton is None:
        raise RuntimeError("fused_moe_small needs triton")
    if not small_supported(x, w13, w2):
        raise ValueError(f"fused_moe_small: x {tuple(x.shape)} {x.dtype}, w13 {tuple(w13.shape)} {w13.dtype}, "
                         f"w2 {tuple(w2.shape)} {w2.dtype}: one float dtype, one device, unit stride along K")
    T, H = x.shape
    E, n2, H13 = w13.shape
    n = n2 // 2
    if H13 != H or tuple(w2.shape) != (E, H, n) or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != T:
        raise ValueError(f"fused_moe_small: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}, "
                         f"topk {tuple(topk_ids.shape)} / {tuple(topk_weights.shape)} disagree")
    k = topk_ids.shape[1]
    y = x.new_empty(T, H)
    if T == 0:
        return y
    x = x if x.stride(1) == 1 else x.contiguous()
    ids = topk_ids.contiguous()
    wts = topk_weights.to(torch.float32).contiguous()
    a = x.new_empty(T * k, n)
    bk = _block_k(H, 512)  # two float32 accumulators of BLOCK_N x BLOCK_K stay in registers
    _gate_up_kernel[(triton.cdiv(n, block_n), T * k)](
        x, w13, ids, wts, a, n, H, x.stride(0), w13.stride(0), w13.stride(1), a.stride(0),
        TOPK=k, SCALE_INPUT=apply_router_weight_on_input, BLOCK_N=block_n, BLOCK_K=bk, EVEN_K=H % bk == 0,
        num_warps=4, **pdl.launch(x.device))
    k_p2 = triton.next_power_of_2(k)
    bk = _block_k(n, max(16, down_tile // (k_p2 * down_block_n)))  # k float32 accumulators of BLOCK_N x BLOCK_K
    _down_kernel[(triton.cdiv(H, down_block_n), T)](
        a, w2, ids, wts, y, H, n, a.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        TOPK=k, TOPK_P2=k_p2, WEIGHT_OUTPUT=not apply_router_weight_on_input, BLOCK_N=down_block_n, BLOCK_K=bk,
        EVEN_K=n % bk == 0, num_warps=4, **pdl.launch(x.device))
    return y
