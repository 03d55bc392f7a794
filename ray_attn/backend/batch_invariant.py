"""Batch-invariant kernels: each row's result does not depend on the other rows of its step.

Why: speculative greedy must give plain greedy's tokens (issue 40).  A plain decode step runs
each request as one query row; a verifying step runs it as 1 + k rows.  With the fastest kernels
the two runs round differently -- the one-row GEMV sums K in another order than cuBLAS at five
rows, and FlashAttention 3 picks its KV split count from the batch -- so at a near-tie in bf16 the
argmax flips and the outputs fork.  vLLM's answer is its batch-invariant mode
(``VLLM_BATCH_INVARIANT=1``): matmuls whose tiles do not change with M, attention with one split.
This is ours, ``ParallelConfig(batch_invariant=True)``; every rank sets it at start
(``set_enabled``), and what it changes on CUDA is:

- ``gemv.linear`` (every bf16/fp16 linear and the LM head) runs ``matmul`` below: one Triton GEMM
  with fixed tiles, no split-K, M not specialized.  Each output element is the same sequence of
  tensor-core steps over K whether its row is alone or one of thousands;
- the one-row GEMV and its fused SiLU-mul are off (``gemv.use_gemv``);
- FlashAttention 3 runs every call with one KV split (``kernels.FlashAttn3Kernel``), its plan too;
- the planner cascades only on a fixed grid (``planner/invariant.py``). Its own choice would
  make a row's attention a merge of two passes or one pass depending on which other rows share
  its prefix in the step; on the grid, where a token's keys split depends on its position alone.

Row-wise kernels (RMSNorm, RoPE, SiLU-mul, the KV-cache write, sampling) are invariant already.
Not covered: FP8 weights (the skinny kernel below 17 rows, ``_scaled_mm`` above), MoE experts (the
small-batch kernels below 9 tokens, the grouped GEMM above) and LoRA; a config asking for those
with it is refused by name (``config.check_batch_invariant``).  On CPU nothing changes: the torch path computes
in float32.  The price is speed: at one row this GEMM reads the weights as a GEMV does but runs
fewer programs.
"""

from __future__ import annotations

import torch

from ray_attn.backend.triton_ops import available

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - CPU machines without triton
    triton = None

_enabled = False

# Fixed for every M: a tile shape that changes with M would change the tensor-core instruction
# (and so the order of the K sum inside it) between a decode row and the same row in a batch.
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64


def set_enabled(on: bool) -> None:
    """Set by every rank from its config (a rank in the driver's process resets it per engine)."""
    global _enabled
    _enabled = bool(on)


def enabled() -> bool:
    return _enabled


if triton is not None:

    @triton.jit(do_not_specialize=["M"])
    def _matmul_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, x_stride, w_stride, y_stride,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        mmask, nmask = rm < M, rn < N
        x_ptrs = x_ptr + rm[:, None].to(tl.int64) * x_stride + rk[None, :]
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * w_stride + rk[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            kmask = (k + rk) < K
            x = tl.load(x_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + rm[:, None].to(tl.int64) * y_stride + rn[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def supports(x: torch.Tensor, w: torch.Tensor) -> bool:
    """What ``matmul`` takes: x [M, K] and w [N, K] in one half dtype, unit stride along K."""
    return (triton is not None and x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1]
            and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype and w.stride(1) == 1
            and x.device == w.device)


def use(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``gemv.linear`` runs ``matmul``: the mode is on and x is a half-dtype CUDA tensor."""
    return _enabled and x.is_cuda and available() and supports(x.reshape(-1, x.shape[-1]), w)


def matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T (+ bias), float32 sums rounded once to x's dtype; row i of the
    result is the same bits whatever the other rows are.  Off a GPU it runs only under
    ``TRITON_INTERPRET=1``."""
    if triton is None:
        raise RuntimeError("batch_invariant.matmul needs triton")
    x2 = x.reshape(-1, x.shape[-1])
    if not supports(x2, w):
        raise ValueError(f"batch_invariant.matmul: x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype}: "
                         "one half dtype, one device, matching K, w of unit stride along K")
    if bias is not None and (bias.shape != (w.shape[0],) or bias.device != w.device):
        raise ValueError(f"batch_invariant.matmul: bias {tuple(bias.shape)} for w {tuple(w.shape)}")
    x2 = x2 if x2.stride(1) == 1 else x2.contiguous()
    M, K = x2.shape
    N = w.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    if M:
        _matmul_kernel[(triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))](
            x2, w, bias if bias is not None else y, y, M, N, K, x2.stride(0), w.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            num_warps=4, num_stages=3)
    return y.reshape(*x.shape[:-1], N)
