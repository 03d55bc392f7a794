"""Llama 4's attention input in one kernel: the interleaved RoPE, the L2 q/k norm after it, or the
NoPE layers' temperature scale on q (``model/llama4.py`` says what each is).

Why: in torch these are ~32 small launches a RoPE layer (the float casts, four products, a stack,
the norm's pow/mean/rsqrt/mul) -- 317 of the 501 kernels of a Scout decode step on the H200
(issue 39's table), 15% of its time.  The kernel computes what the torch code computes, in
float32 with the same two roundings (after RoPE, after the norm); only FMA contraction in the
rotation can move a value across a bf16 rounding boundary now and then.  CPU and every case it
does not cover run the torch functions, the reference.
"""

from __future__ import annotations

import torch

from ray_attn.backend import pdl
from ray_attn.model.fused import _use_triton

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - CPU machines without triton
    triton = None


if triton is not None:

    @triton.jit
    def _llama4_qk_kernel(x_ptr, cos_ptr, sin_ptr, temp_ptr, out_ptr, NQ, H, eps, x_st, x_sh, cs_st,
                          D: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                          ROPE: tl.constexpr, L2: tl.constexpr, TEMP: tl.constexpr, USE_PDL: tl.constexpr):
        if USE_PDL:  # pdl.py: nothing an earlier kernel writes is read before the wait
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        t = tl.program_id(0).to(tl.int64)
        hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        js = tl.arange(0, BLOCK_D)  # pair j: elements 2j and 2j + 1 (Meta's interleaved layout)
        jmask = js < HALF
        mask = (hs < H)[:, None] & jmask[None, :]
        dt = out_ptr.dtype.element_ty
        xp = x_ptr + t * x_st + hs[:, None].to(tl.int64) * x_sh + 2 * js[None, :]
        x0 = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
        x1 = tl.load(xp + 1, mask=mask, other=0.0).to(tl.float32)
        if ROPE:
            c = tl.load(cos_ptr + t * cs_st + js, mask=jmask, other=0.0)[None, :]
            s = tl.load(sin_ptr + t * cs_st + js, mask=jmask, other=0.0)[None, :]
            x0, x1 = x0 * c - x1 * s, x0 * s + x1 * c
            x0, x1 = x0.to(dt).to(tl.float32), x1.to(dt).to(tl.float32)  # rope_interleaved's rounding
        if L2:
            r = tl.rsqrt(tl.sum(x0 * x0 + x1 * x1, axis=1) / D + eps)[:, None]
            x0, x1 = x0 * r, x1 * r
        if TEMP:  # q heads only: (q * temperature[t]).to(q.dtype)
            scale = tl.where((hs < NQ)[:, None], tl.load(temp_ptr + t), 1.0)
            x0, x1 = x0 * scale, x1 * scale
        op = out_ptr + t * H * D + hs[:, None].to(tl.int64) * D + 2 * js[None, :]
        tl.store(op, x0.to(dt), mask=mask)
        tl.store(op + 1, x1.to(dt), mask=mask)


def llama4_qk_launch(qk: torch.Tensor, num_q_heads: int, cos, sin, l2_eps, temperature):
    """The kernel on ``qk`` [T, nq + nk, D] (any token and head stride, unit stride in D) ->
    (q [T, nq, D], k [T, nk, D]), views of one fresh tensor.  ``cos``/``sin`` [T, 1, D/2] float32
    or None; ``l2_eps`` None for no norm; ``temperature`` [T, 1, 1] float32 or None."""
    T, H, D = qk.shape
    out = torch.empty(T, H, D, dtype=qk.dtype, device=qk.device)
    if T and H:
        rope, temp = cos is not None, temperature is not None
        BLOCK_H = min(triton.next_power_of_2(H), 8)
        _llama4_qk_kernel[(T, triton.cdiv(H, BLOCK_H))](
            qk, cos if rope else qk, sin if rope else qk, temperature if temp else qk, out, num_q_heads, H,
            float(l2_eps or 0.0), qk.stride(0), qk.stride(1), cos.stride(0) if rope else 0, D=D, HALF=D // 2,
            BLOCK_H=BLOCK_H, BLOCK_D=triton.next_power_of_2(D // 2), ROPE=rope, L2=l2_eps is not None, TEMP=temp,
            **pdl.launch(qk.device))
    return out[:, :num_q_heads], out[:, num_q_heads:]


def llama4_qk_ok(qk: torch.Tensor, cos, sin, temperature) -> bool:
    """Whether the kernel serves this case (CUDA, the layouts it assumes)."""
    T, H, D = qk.shape
    ok = _use_triton(qk) and qk.stride(2) == 1 and D % 2 == 0
    if cos is not None:
        ok = ok and (cos.shape == sin.shape == (T, 1, D // 2) and cos.dtype == sin.dtype == torch.float32
                     and cos.stride() == sin.stride() and cos.stride(2) == 1)
    if temperature is not None:
        ok = ok and temperature.dtype == torch.float32 and temperature.numel() == T and temperature.is_contiguous()
    return ok
