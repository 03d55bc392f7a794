"""y = x W^T for one row (decode at batch 1), as one Triton kernel.

Why: at batch 1 a decode step is a stream of weight reads.  cuBLAS reads the wide matrices
(gate_up, the LM head) at the copy rate, but the narrow ones -- qkv, o_proj, down_proj, N <= 8192
-- at 60-89% of it, and splits K for o_proj and down_proj, which adds a reduce kernel to each.
This kernel gives each program 8 whole rows of W and streams them once over K in 1024-wide steps,
keeping the dot products in float32 registers: no split, no second kernel, N / 8 programs.

Measured on an H200, replayed from CUDA graphs over 32 layers' weights
(``scripts/probe_decode_kernels.py``, benchmarks/NOTES.md): at one row, o_proj 13.2 -> 10.6 us,
down_proj 31.2 -> 28.8 us, qkv 15.3 -> 14.6 us; gate_up (55 us) and the LM head are as fast in
cuBLAS.  At two rows or more cuBLAS's tiles share each weight load across the rows and this
kernel loses (o_proj 13.2 vs 14.0 us at two rows, 2x slower at four), so it serves one row only.
Everything else -- other dtypes, wider N, more rows -- is ``F.linear``; float32 on CPU is
oneDNN's matmul or MKL's, by rows and machine (``use_onednn``).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ray_attn.backend import batch_invariant, pdl
from ray_attn.model import gguf_q4, kernel_configs, skinny

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - CPU machines without triton
    triton = None

MAX_ROWS = 1  # from two rows on, cuBLAS wins (see above)
MAX_N = 8192  # wider outputs (gate_up, the LM head) already stream at the copy rate in cuBLAS
# RAY_ATTN_GEMV=0 turns the kernel off (an A/B switch for benchmarks; read once, at import).
ENABLED = os.environ.get("RAY_ATTN_GEMV", "1") != "0"
# RAY_ATTN_GEMV_SILU=0 keeps SiLU-mul a kernel of its own before down_proj's GEMV (A/B switch).
FUSE_SILU = os.environ.get("RAY_ATTN_GEMV_SILU", "1") != "0"

if triton is not None:
    from ray_attn.model.skinny import silu_mul_rounded  # the SiLU-mul rounding both fusions share

    @triton.jit
    def _gemv_w(w_ptrs, k, K, nmask, rk, EVEN_K: tl.constexpr):
        if EVEN_K:
            return tl.load(w_ptrs, mask=nmask[:, None], other=0.0, eviction_policy="evict_first")
        return tl.load(w_ptrs, mask=nmask[:, None] & ((k + rk) < K)[None, :], other=0.0, eviction_policy="evict_first")

    @triton.jit
    def _gemv_step(acc, w, x_ptrs, x_dtype: tl.constexpr, k, K, mmask, rk, EVEN_K: tl.constexpr,
                   SILU_MUL: tl.constexpr):
        """acc += x[:, k:k+BLOCK_K] * w, elementwise per K lane (summed once at the end)."""
        if EVEN_K:
            x = tl.load(x_ptrs, mask=mmask[:, None], other=0.0)
        else:
            x = tl.load(x_ptrs, mask=mmask[:, None] & ((k + rk) < K)[None, :], other=0.0)
        if SILU_MUL:
            # x holds gate and up ([M, 2K]): silu(gate) * up made here, rounded where the
            # silu_mul kernel rounds (fused.py), so the product is that kernel's to the bit.
            u = tl.load(x_ptrs + K, mask=mmask[:, None] & ((k + rk) < K)[None, :], other=0.0)
            x = silu_mul_rounded(x, u, x_dtype)
        return acc + x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, ws_ptr, y_ptr, M, N, K, x_stride, w_stride, y_stride,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SILU_MUL: tl.constexpr,
                     W_SCALE: tl.constexpr, USE_PDL: tl.constexpr):
        """W_SCALE: w holds e4m3 codes with float32 scales per output row (``ws_ptr``), applied
        to the float32 sum: weight-only FP8 (``w8a16``), x left in the model dtype."""
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        nmask = rn < N
        mmask = rm < M
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * w_stride + rk[None, :]
        x_ptrs = x_ptr + rm[:, None] * x_stride + rk[None, :]
        # The first K step is peeled: its weight tile is loaded before the wait for the kernel
        # before (PDL, pdl.py) -- weights are never written during a step -- and x after it.
        w = _gemv_w(w_ptrs, 0, K, nmask, rk, EVEN_K)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        # Partial products stay per K lane until the end: one reduction per row, not per step.
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc = _gemv_step(acc, w, x_ptrs, x_ptr.dtype.element_ty, 0, K, mmask, rk, EVEN_K, SILU_MUL)
        for k in range(BLOCK_K, K, BLOCK_K):
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            w = _gemv_w(w_ptrs, k, K, nmask, rk, EVEN_K)
            acc = _gemv_step(acc, w, x_ptrs, x_ptr.dtype.element_ty, k, K, mmask, rk, EVEN_K, SILU_MUL)
        y = tl.sum(acc, axis=2)
        if W_SCALE:
            y *= tl.load(ws_ptr + rn, mask=nmask, other=0.0)[None, :]
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * y_stride + rn[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])


def config(m: int, n: int, k: int) -> dict:
    """Block sizes for an (m, n, k) product: 8 rows of W per program (N = 4096 gives 512
    programs, ~4 per SM of an H200) and 16 KB of weights per K step at one row; a narrower K step
    for more rows keeps the float32 partial sums (BLOCK_M x BLOCK_N x BLOCK_K) in registers.  A
    device's tuned table (``kernel_configs.py``) overrides these per weight shape."""
    block_m = triton.next_power_of_2(max(m, 1))
    block_k = 1024 if block_m == 1 else 256 if block_m <= 2 else 128
    return dict(BLOCK_M=block_m, BLOCK_N=8, BLOCK_K=block_k, num_warps=4, num_stages=3)


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
         w_scale: torch.Tensor | None = None, **cfg) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T (+ bias) on CUDA with the Triton kernel; ``cfg`` overrides ``config``.
    ``silu_mul``: x is [M, 2K], gate then up, and the kernel multiplies silu(gate) * up itself
    (down_proj after a SwiGLU: one kernel, not two).  ``w_scale``: w is e4m3 with these float32
    scales per row [N] (weight-only FP8, ``fp8.py``'s ``w8a16``)."""
    m, k = x.shape
    k = k // 2 if silu_mul else k
    n = w.shape[0]
    if w.shape[1] != k or w.stride(1) != 1 or x.stride(1) != 1 or (silu_mul and x.shape[1] != 2 * k):
        raise ValueError(f"gemv: x {tuple(x.shape)} and w {tuple(w.shape)} must agree on K"
                         f"{' (x: gate and up, 2K)' if silu_mul else ''}, unit stride")
    if w_scale is not None and (w.element_size() != 1 or w_scale.numel() != n or w_scale.dtype != torch.float32):
        raise ValueError(f"gemv: a weight-only FP8 weight must be e4m3 with float32 scales [N={n}], got "
                         f"{w.dtype} and scales {tuple(w_scale.shape)} {w_scale.dtype}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    table = "w8a16" if w_scale is not None else "gemv"
    c = {**config(m, n, k), **kernel_configs.tuned(table, m, n, k, x.device), **cfg}
    grid = (triton.cdiv(n, c["BLOCK_N"]),)
    _gemv_kernel[grid](x, w, bias if bias is not None else w, w_scale if w_scale is not None else x, y, m, n, k,
                       x.stride(0), w.stride(0), y.stride(0), HAS_BIAS=bias is not None,
                       EVEN_K=k % c["BLOCK_K"] == 0, SILU_MUL=silu_mul, W_SCALE=w_scale is not None,
                       **pdl.launch(x.device), **c)
    return y


def silu_mul_input_ok(gate_up: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``gate_up`` is laid out for the GEMV to make silu(gate) * up itself before ``w``
    ([M, 2K] gate then up, unit stride) and the fusion is on: the bf16 and the w8a16 paths' shared check."""
    return FUSE_SILU and gate_up.dim() == 2 and gate_up.shape[-1] == 2 * w.shape[1] and gate_up.stride(1) == 1


def use_gemv_silu_mul(gate_up: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether down_proj's GEMV can take ``gate_up`` [M, 2K] and make silu(gate) * up itself."""
    return silu_mul_input_ok(gate_up, w) and use_gemv(gate_up[:, :w.shape[1]], w)


def linear_silu_mul(gate_up: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """``linear(silu_mul(gate_up), w)`` for a bf16/fp16 down_proj, the product made inside the
    linear's own kernel: the GEMV at one row, and, opted in (``skinny.FUSE_SILU``), the skinny
    kernel at 2-16 rows on a tuned shape.  None where neither serves: the caller runs the two
    apart."""
    if not silu_mul_input_ok(gate_up, w):
        return None
    gate = gate_up[:, :w.shape[1]]
    if use_gemv(gate, w):
        return gemv(gate_up, w, silu_mul=True)
    if skinny.FUSE_SILU and skinny.use_skinny(gate, w):
        return skinny.skinny(gate_up, w, silu_mul=True)
    return None


def use_gemv(x: torch.Tensor, w: torch.Tensor) -> bool:
    """One row on CUDA in bf16/fp16: N <= MAX_N, or a wider shape this device's tuned table holds
    (``scripts/tune_decode_gemv.py`` writes one there only where the GEMV beat cuBLAS)."""
    return (ENABLED and skinny.half_rows_on_cuda(x, w, 0, MAX_ROWS)
            and (w.shape[0] <= MAX_N or bool(kernel_configs.tuned("gemv", 1, w.shape[0], w.shape[1], x.device))))


def _onednn_available() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


def _cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


# float32 on CPU: oneDNN's matmul (the op torch.compile's CPU backend emits) or F.linear's MKL
# sgemm, whichever the rows favour.  On 2 AMD EPYC cores oneDNN won at every size (SmolLM2-135M's
# decode linears at batch 8 in 36 ms against MKL's 64; batch 1: 16 vs 21).  On 2 Intel Xeon cores
# MKL wins up to 3 rows and loses from 4 (all 30 layers' linears at 1 / 3 / 4 rows: MKL 16.4 /
# 20.5 / 30.5 ms, oneDNN 24.8 / 31.8 / 33.5; the LM head 4.3 / 5.1 / 9.1 against 4.4 / 6.4 / 6.5):
# a plain decode step at batch 1 and a step verifying 2 drafts stay on MKL there
# (``python scripts/bench_cpu_linear.py`` prints this table for the machine it runs on).  The
# choice is a fixed rule of the vendor and the row count, not a timing taken at start-up, so every
# process on a machine -- the TP ranks, a test's in-process reference -- sums in the same order.
# RAY_ATTN_CPU_ONEDNN=1 / 0 forces oneDNN / MKL at every size (read once, at import).
_ONEDNN_ENV = os.environ.get("RAY_ATTN_CPU_ONEDNN", "auto")
CPU_ONEDNN = _ONEDNN_ENV != "0" and _onednn_available()


def mkl_max_rows(env: str, vendor: str) -> int:
    """Rows up to which float32 CPU linears stay on MKL (0: oneDNN at every size)."""
    return 0 if env == "1" else 3 if vendor == "GenuineIntel" else 0


CPU_MKL_MAX_ROWS = mkl_max_rows(_ONEDNN_ENV, _cpu_vendor())


def use_onednn(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (CPU_ONEDNN and not x.is_cuda and x.dim() == 2 and x.shape[0] > CPU_MKL_MAX_ROWS
            and x.dtype == torch.float32 and w.dtype == torch.float32 and w.is_contiguous() and x.is_contiguous())


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with the Triton GEMV for one row and N <= MAX_N on CUDA, the skinny tensor-core
    kernel for 2-16 rows on shapes this GPU's table gives it (``skinny.py``), oneDNN's matmul for
    float32 on CPU where it is the faster (``use_onednn``), and a GGUF's own 4-bit blocks on CPU
    where the model packed them (``gguf_q4``, quantization='gguf')."""
    if not x.is_cuda:
        q = gguf_q4.packed(w)
        if q is not None:
            return gguf_q4.linear(x, q, bias)
    if batch_invariant.use(x, w):
        return batch_invariant.matmul(x, w, bias)
    if use_gemv(x, w):
        return gemv(x if x.stride(1) == 1 else x.contiguous(), w, bias)
    if skinny.use_skinny(x, w) and (bias is None or bias.is_contiguous()):
        return skinny.skinny(x if x.stride(1) == 1 else x.contiguous(), w, bias)
    if use_onednn(x, w):
        return torch.ops.mkldnn._linear_pointwise(x, onednn_weight(w), bias, "none", [], "")
    return F.linear(x, w, bias)


# oneDNN's matmul reads a weight in its own blocked layout; handed a plain one, it reorders it on
# every call.  Packed once (``_reorder_linear_weight``, Inductor's CPU freezing does the same), all
# 30 SmolLM2 layers' linears took 21.8 / 24.9 / 30.9 ms at 4 / 8 / 16 rows against 30.6 / 32.8 /
# 38.8 plain, on 2 Intel Xeon cores -- whichever row count the layout was packed for
# (``python scripts/bench_cpu_linear.py --packed``).  The packed copy is made on the first call
# that needs it (a batch-1 server never pays its memory) and again whenever the weight changes in
# place (a reload bumps its version counter).  RAY_ATTN_CPU_PACK=0 turns it off (A/B switch).
PACK = os.environ.get("RAY_ATTN_CPU_PACK", "1") != "0"
PACK_ROWS = 8  # the layout's row hint: any row count runs on it, at the speeds above
_PACKED = "_ray_attn_onednn_packed"


def onednn_weight(w: torch.Tensor) -> torch.Tensor:
    """``w`` as oneDNN's matmul reads it fastest: packed once per version of ``w``; ``w`` itself
    where it cannot be tracked (an inference tensor keeps no version) or packing is off."""
    if not PACK or w.is_inference():
        return w
    version = w._version
    cached = w.__dict__.get(_PACKED)
    if cached is not None and cached[0] == version:
        return cached[1]
    packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)
    setattr(w, _PACKED, (version, packed))
    return packed
