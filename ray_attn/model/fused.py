"""One-kernel versions of the decoder's small elementwise ops: RMSNorm, residual add + RMSNorm,
RoPE and SiLU-and-mul.

Why: a CUDA-graph decode step is bound by kernel count, and in torch these ops cost ~20
elementwise kernels per layer.  The Triton path runs only on CUDA when Triton imports; elsewhere
the functions are the exact torch code the model used before, so CPU results are unchanged.
Every launch is shape-static with no host sync, so all of them can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ray_attn.backend.triton_ops import available

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - CPU machines without triton
    triton = None


def _use_triton(*tensors: torch.Tensor) -> bool:
    return available() and all(t.is_cuda for t in tensors)


def _num_warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last] with unit stride in the last dim (a view when x allows it)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, d_ptr, w_ptr, out_ptr, sum_ptr, x_stride, d_stride, eps,
                         N: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        x = tl.load(x_ptr + t * x_stride + offs, mask=mask, other=0.0)
        if ADD:
            # Round the sum to x's dtype first, as torch's ``x + delta`` does.
            d = tl.load(d_ptr + t * d_stride + offs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(sum_ptr + t * N + offs, x, mask=mask)
        xf = x.to(tl.float32)
        r = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
        # HF Llama's order: normalise in float32, round to x's dtype, then scale by the weight.
        h = (xf * r).to(x_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * N + offs, (h * w).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, x_st, x_sh, cs_st, o_st, o_sh,
                     HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        ds = tl.arange(0, BLOCK_D)
        dmask = ds < HALF
        mask = (hs < H)[:, None] & dmask[None, :]
        c = tl.load(cos_ptr + t * cs_st + ds, mask=dmask, other=0.0).to(tl.float32)[None, :]
        s = tl.load(sin_ptr + t * cs_st + ds, mask=dmask, other=0.0).to(tl.float32)[None, :]
        xp = x_ptr + t * x_st + hs[:, None].to(tl.int64) * x_sh + ds[None, :]
        x1 = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(xp + HALF, mask=mask, other=0.0).to(tl.float32)
        op = out_ptr + t * o_st + hs[:, None].to(tl.int64) * o_sh + ds[None, :]
        tl.store(op, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(op + HALF, (x2 * c + x1 * s).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, x_stride, N: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        g = tl.load(x_ptr + t * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + t * x_stride + N + offs, mask=mask, other=0.0).to(tl.float32)
        # Round silu to the dtype before the product, as torch's two kernels do: the graph and
        # eager paths then agree bit for bit with the unfused model.
        a = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + t * N + offs, (a * u).to(out_ptr.dtype.element_ty), mask=mask)


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # F.rms_norm is one kernel where torch fuses it; the weight scales after the cast, as in HF.
    h = F.rms_norm(x.float(), weight.shape, eps=eps)
    return weight * h.to(x.dtype)


def _rms_norm_launch(x, delta, weight, eps):
    N = x.shape[-1]
    x2 = _rows(x)
    d2 = _rows(delta) if delta is not None else x2
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device) if delta is not None else out
    if x2.shape[0]:
        BLOCK = triton.next_power_of_2(N)
        _rms_norm_kernel[(x2.shape[0],)](x2, d2, weight, out, s, x2.stride(0), d2.stride(0), float(eps),
                                         N=N, BLOCK=BLOCK, ADD=delta is not None,
                                         num_warps=_num_warps(BLOCK))
    return s, out


def _norm_ok(x, weight) -> bool:
    return (weight.dtype == x.dtype and weight.dim() == 1 and weight.is_contiguous()
            and weight.shape[0] == x.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * rms_norm(x.float()).to(x.dtype)``, normalised over the last dim."""
    if not (_use_triton(x, weight) and _norm_ok(x, weight)):
        return _rms_norm_torch(x, weight, eps)
    return _rms_norm_launch(x, None, weight, eps)[1]


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + delta, rms_norm(x + delta))``: a residual add and the norm after it, one kernel."""
    if not (_use_triton(x, delta, weight) and _norm_ok(x, weight) and delta.shape == x.shape
            and delta.dtype == x.dtype):
        s = x + delta
        return s, _rms_norm_torch(s, weight, eps)
    return _rms_norm_launch(x, delta, weight, eps)


def apply_rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               inplace: bool = False) -> torch.Tensor:
    """Neox-style RoPE on ``qk`` [T, heads, D] with ``cos``/``sin`` [T, 1, D/2].

    ``qk`` may be a view over rows of a wider tensor (the fused qkv output): any token and head
    stride works as long as each head's D values are contiguous.  The Triton path computes in
    float32 and rounds once; the torch path is the model's original code.
    """
    T, H, D = qk.shape
    ok = (_use_triton(qk, cos, sin) and qk.stride(2) == 1 and cos.shape == sin.shape
          and cos.shape == (T, 1, D // 2) and D % 2 == 0 and cos.stride() == sin.stride()
          and cos.stride(2) == 1)
    if not ok:
        x1, x2 = qk.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return qk.copy_(out) if inplace else out
    out = qk if inplace else torch.empty(T, H, D, dtype=qk.dtype, device=qk.device)
    if T and H:
        # A few heads per program: cos/sin are loaded once per token block, registers stay small.
        BLOCK_H = min(triton.next_power_of_2(H), 8)
        grid = (T, triton.cdiv(H, BLOCK_H))
        _rope_kernel[grid](qk, cos, sin, out, H, qk.stride(0), qk.stride(1), cos.stride(0),
                           out.stride(0), out.stride(1), HALF=D // 2, BLOCK_H=BLOCK_H,
                           BLOCK_D=triton.next_power_of_2(D // 2))
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = cat(gate, up)`` along the last dim."""
    if not _use_triton(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    N = gate_up.shape[-1] // 2
    x2 = _rows(gate_up)
    out = torch.empty(*gate_up.shape[:-1], N, dtype=gate_up.dtype, device=gate_up.device)
    if x2.shape[0] and N:
        BLOCK = min(triton.next_power_of_2(N), 1024)
        _silu_mul_kernel[(x2.shape[0], triton.cdiv(N, BLOCK))](x2, out, x2.stride(0), N=N, BLOCK=BLOCK)
    return out
