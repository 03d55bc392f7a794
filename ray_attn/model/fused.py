"""One-kernel versions of the decoder's small elementwise ops: RMSNorm, residual add + RMSNorm,
RoPE, SiLU-and-mul, and Qwen3's per-head q/k RMSNorm with RoPE.

The norms and SiLU-and-mul also quantize their output for an FP8 linear after them (``quant=``):
the codes and per-row scales are written by the same kernel, so the linear needs no quantizer
launch of its own (vLLM's Inductor pass fuses RMSNorm + quant and SiLU-mul + quant the same way).
The codes are the standalone quantizer's: the same float32 value, division and rounding.

Why: a CUDA-graph decode step is bound by kernel count, and in torch these ops cost ~20
elementwise kernels per layer.  The Triton path runs only on CUDA when Triton imports; elsewhere
the functions are the exact torch code the model used before, so CPU results are unchanged.
Every launch is shape-static with no host sync, so all of them can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ray_attn.backend.triton_ops import available
from ray_attn.backend import pdl
from ray_attn.model.fp8 import QuantizedActivation, quantize_per_token
from ray_attn.model.fp8_kernels import FP8_DTYPE, INTERPRET

try:
    import triton
    import triton.language as tl

    from ray_attn.model.fp8_kernels import _quantize
except Exception:  # pragma: no cover - CPU machines without triton
    triton = None


# The widest row the SiLU-mul quantizer holds in registers (16 warps, 64 values a thread); wider
# ones (an unsharded 70B MLP) go out unquantized, and the FP8 linear quantizes them itself.
QUANT_MAX_N = 32768


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
    def _rms_norm_kernel(x_ptr, d_ptr, w_ptr, out_ptr, sum_ptr, q_ptr, s_ptr, x_stride, d_stride, eps,
                         N: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr, QUANT: tl.constexpr,
                         INTERPRET: tl.constexpr, USE_PDL: tl.constexpr):
        if USE_PDL:  # pdl.py: nothing an earlier kernel writes is read before the wait
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
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
        y = (h * w).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + t * N + offs, y, mask=mask)
        if QUANT:
            _store_codes(y.to(tl.float32), q_ptr + t * N + offs, s_ptr + t, mask, INTERPRET)

    @triton.jit
    def _store_codes(yf, q_ptrs, s_ptr, mask, INTERPRET: tl.constexpr):
        # quantize_per_token_triton's math on a row held in registers: scale = max|y| / 448 (at
        # least vLLM's floor), codes by IEEE division and round-to-nearest-even.
        sx = tl.maximum(tl.math.div_rn(tl.max(tl.where(mask, tl.abs(yf), 0.0), axis=0), 448.0),
                        1.0 / (448.0 * 512.0))
        tl.store(q_ptrs, _quantize(yf, sx, INTERPRET), mask=mask)
        tl.store(s_ptr, sx)

    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, x_st, x_sh, cs_st, o_st, o_sh,
                     HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr):
        if USE_PDL:  # pdl.py: nothing an earlier kernel writes is read before the wait
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
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
    def _silu_mul_kernel(x_ptr, out_ptr, x_stride, N: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
        if USE_PDL:  # pdl.py: nothing an earlier kernel writes is read before the wait
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        g = tl.load(x_ptr + t * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + t * x_stride + N + offs, mask=mask, other=0.0).to(tl.float32)
        # Round silu to the dtype before the product, as torch's two kernels do: the graph and
        # eager paths then agree bit for bit with the unfused model.
        a = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + t * N + offs, (a * u).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_value(x_ptr, offs, mask, N: tl.constexpr, dtype: tl.constexpr):
        g = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + N + offs, mask=mask, other=0.0).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        return (a * u).to(dtype)

    @triton.jit
    def _silu_mul_quant_kernel(x_ptr, out_ptr, q_ptr, s_ptr, x_stride, N: tl.constexpr, BLOCK: tl.constexpr,
                               STORE_VALUE: tl.constexpr, INTERPRET: tl.constexpr, USE_PDL: tl.constexpr):
        """One program per row (the scale needs the row's max), the whole row in registers:
        BLOCK >= N.  A two-pass loop over 1024-wide pieces ran 15.8 us a row at N = 14336 on the
        H200 (the unfused pair: ~4.5 us), each piece's loads waiting on the last."""
        if USE_PDL:  # pdl.py: nothing an earlier kernel writes is read before the wait
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        t = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        y = _silu_mul_value(x_ptr + t * x_stride, offs, mask, N, out_ptr.dtype.element_ty)
        if STORE_VALUE:  # else only the codes are read: the product is never written (out_ptr: its dtype)
            tl.store(out_ptr + t * N + offs, y, mask=mask)
        _store_codes(y.to(tl.float32), q_ptr + t * N + offs, s_ptr + t, mask, INTERPRET)

    @triton.jit
    def _qk_norm_rope_kernel(x_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, out_ptr, NQ, H, eps, x_st, x_sh, cs_st,
                             D: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                             ROPE: tl.constexpr, USE_PDL: tl.constexpr):
        """Qwen3's q/k heads: RMSNorm over each head (q heads by q_norm's weight, k heads by
        k_norm's), rounded as the norm kernel rounds, then neox RoPE in float32, rounded once --
        what rms_norm then apply_rope compute, in one kernel instead of four."""
        if USE_PDL:  # pdl.py: nothing an earlier kernel writes is read before the wait
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        t = tl.program_id(0).to(tl.int64)
        hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        ds = tl.arange(0, BLOCK_D)
        dmask = ds < HALF
        mask = (hs < H)[:, None] & dmask[None, :]
        dt = out_ptr.dtype.element_ty
        xp = x_ptr + t * x_st + hs[:, None].to(tl.int64) * x_sh + ds[None, :]
        x1 = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(xp + HALF, mask=mask, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x1 * x1 + x2 * x2, axis=1) / D + eps)[:, None]
        isq = (hs < NQ)[:, None]
        w1 = tl.where(isq, tl.load(qw_ptr + ds, mask=dmask, other=0.0).to(tl.float32)[None, :],
                      tl.load(kw_ptr + ds, mask=dmask, other=0.0).to(tl.float32)[None, :])
        w2 = tl.where(isq, tl.load(qw_ptr + HALF + ds, mask=dmask, other=0.0).to(tl.float32)[None, :],
                      tl.load(kw_ptr + HALF + ds, mask=dmask, other=0.0).to(tl.float32)[None, :])
        h1 = ((x1 * r).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
        h2 = ((x2 * r).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
        if ROPE:
            c = tl.load(cos_ptr + t * cs_st + ds, mask=dmask, other=0.0).to(tl.float32)[None, :]
            s = tl.load(sin_ptr + t * cs_st + ds, mask=dmask, other=0.0).to(tl.float32)[None, :]
            h1, h2 = h1 * c - h2 * s, h2 * c + h1 * s
        op = out_ptr + t * H * D + hs[:, None].to(tl.int64) * D + ds[None, :]
        tl.store(op, h1.to(dt), mask=mask)
        tl.store(op + HALF, h2.to(dt), mask=mask)


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # F.rms_norm is one kernel where torch fuses it; the weight scales after the cast, as in HF.
    h = F.rms_norm(x.float(), weight.shape, eps=eps)
    return weight * h.to(x.dtype)


def _rms_norm_launch(x, delta, weight, eps, quant=False):
    """(x + delta or None, the norm's output, its codes or None, their scales or None)."""
    N = x.shape[-1]
    x2 = _rows(x)
    d2 = _rows(delta) if delta is not None else x2
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device) if delta is not None else out
    q = torch.empty(x2.shape, dtype=FP8_DTYPE, device=x.device) if quant else out
    scale = torch.empty(x2.shape[0], 1, dtype=torch.float32, device=x.device) if quant else out
    if x2.shape[0]:
        BLOCK = triton.next_power_of_2(N)
        _rms_norm_kernel[(x2.shape[0],)](x2, d2, weight, out, s, q, scale, x2.stride(0), d2.stride(0), float(eps),
                                         N=N, BLOCK=BLOCK, ADD=delta is not None, QUANT=quant,
                                         INTERPRET=INTERPRET, num_warps=_num_warps(BLOCK), **pdl.launch(x.device))
    return s, out, (q if quant else None), (scale if quant else None)


def _quantized(y: torch.Tensor, q=None, scale=None) -> QuantizedActivation:
    """y with its codes: the kernel's, or the torch reference quantizer's (CPU, fallbacks)."""
    if q is None:
        q, scale = quantize_per_token(y.reshape(-1, y.shape[-1]))
    return QuantizedActivation(y, q, scale)


def _norm_ok(x, weight) -> bool:
    return (weight.dtype == x.dtype and weight.dim() == 1 and weight.is_contiguous()
            and weight.shape[0] == x.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, quant: bool = False):
    """``weight * rms_norm(x.float()).to(x.dtype)``, normalised over the last dim; with ``quant``
    a ``QuantizedActivation`` of it (for an FP8 linear: ``Fp8Linear.wants_fp8_input``)."""
    if not (_use_triton(x, weight) and _norm_ok(x, weight)):
        y = _rms_norm_torch(x, weight, eps)
        return _quantized(y) if quant else y
    _, y, q, scale = _rms_norm_launch(x, None, weight, eps, quant)
    return _quantized(y, q, scale) if quant else y


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 quant: bool = False) -> tuple[torch.Tensor, torch.Tensor | QuantizedActivation]:
    """``(x + delta, rms_norm(x + delta))``: a residual add and the norm after it, one kernel
    (``quant``: the norm as a ``QuantizedActivation``, from the same kernel)."""
    if not (_use_triton(x, delta, weight) and _norm_ok(x, weight) and delta.shape == x.shape
            and delta.dtype == x.dtype):
        s = x + delta
        y = _rms_norm_torch(s, weight, eps)
        return s, _quantized(y) if quant else y
    s, y, q, scale = _rms_norm_launch(x, delta, weight, eps, quant)
    return s, _quantized(y, q, scale) if quant else y


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
                           BLOCK_D=triton.next_power_of_2(D // 2), **pdl.launch(qk.device))
    return out


def silu_mul(gate_up: torch.Tensor, quant: bool = False, value: bool = True):
    """``silu(gate) * up`` for ``gate_up = cat(gate, up)`` along the last dim (``quant``: as a
    ``QuantizedActivation``, codes from the same kernel; ``value=False``: the caller reads only
    the codes, and the kernel does not write the product -- see ``silu_mul_launch``)."""
    if quant and gate_up.shape[-1] // 2 > QUANT_MAX_N and _use_triton(gate_up):
        return silu_mul_launch(gate_up)  # too wide to quantize here: the linear's quantizer will
    if not _use_triton(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        y = F.silu(gate) * up
        return _quantized(y) if quant else y
    return silu_mul_launch(gate_up, quant, value)


_NAN: dict = {}


def _absent(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A stand-in of ``shape`` for a product that was not written: one NaN seen through stride-0
    views (the FP8 linear takes only its shape and dtype), so that a reader it was not meant for
    gets NaNs, not stale memory.  One element per dtype and device, made before any graph capture
    that reuses it."""
    key = (dtype, device)
    one = _NAN.get(key)
    if one is None:
        one = torch.full((1,), float("nan"), dtype=dtype, device=device)
        if not (one.is_cuda and torch.cuda.is_current_stream_capturing()):  # a capture runs no fill
            _NAN[key] = one
    return one.view(*([1] * len(shape))).expand(*shape)


def silu_mul_launch(gate_up: torch.Tensor, quant: bool = False, value: bool = True):
    """The Triton path of ``silu_mul`` (also what the interpreter tests call on CPU tensors).
    With ``quant`` and not ``value``, the product is not stored: at 8,192 rows of the 8B's
    14,336 columns that write is 235 MB of the kernel's 822 MB, a quarter of its time in an FP8
    prefill step (README, issue 39)."""
    N = gate_up.shape[-1] // 2
    x2 = _rows(gate_up)
    store = value or not quant
    out_shape = (*gate_up.shape[:-1], N)
    out = (torch.empty(out_shape, dtype=gate_up.dtype, device=gate_up.device) if store
           else _absent(out_shape, gate_up.dtype, gate_up.device))
    q = torch.empty(x2.shape[0], N, dtype=FP8_DTYPE, device=gate_up.device) if quant else None
    scale = torch.empty(x2.shape[0], 1, dtype=torch.float32, device=gate_up.device) if quant else None
    if x2.shape[0] and N:
        BLOCK = min(triton.next_power_of_2(N), 1024)
        if quant:
            full = triton.next_power_of_2(N)
            _silu_mul_quant_kernel[(x2.shape[0],)](x2, out, q, scale, x2.stride(0), N=N, BLOCK=full,
                                                   STORE_VALUE=store, INTERPRET=INTERPRET, num_warps=_num_warps(full),
                                                   **pdl.launch(x2.device))
        else:
            _silu_mul_kernel[(x2.shape[0], triton.cdiv(N, BLOCK))](x2, out, x2.stride(0), N=N, BLOCK=BLOCK,
                                                                   **pdl.launch(x2.device))
    return _quantized(out, q, scale) if quant else out


def qk_norm_rope(qk: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                 cos: torch.Tensor | None, sin: torch.Tensor | None, num_q_heads: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's attention input: ``qk`` [T, nq + nk, D] (a view over the fused qkv output) ->
    (q [T, nq, D], k [T, nk, D]) RMS-normalised per head by q_weight / k_weight, then RoPE'd
    (``cos``/``sin`` [T, 1, D/2]; None for none).  Views of one fresh tensor; on CUDA one kernel,
    elsewhere ``rms_norm`` then ``apply_rope`` (the model's original code)."""
    T, H, D = qk.shape
    rope = cos is not None
    ok = (_use_triton(qk, q_weight, k_weight) and qk.stride(2) == 1 and D % 2 == 0
          and all(_norm_ok(qk, w) for w in (q_weight, k_weight))
          and (not rope or (cos.shape == sin.shape == (T, 1, D // 2) and cos.stride() == sin.stride()
                            and cos.stride(2) == 1)))
    if not ok:
        q, k = qk.split([num_q_heads, H - num_q_heads], dim=1)
        q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)  # fresh: rotated in place
        if rope:
            q, k = apply_rope(q, cos, sin, inplace=True), apply_rope(k, cos, sin, inplace=True)
        return q, k
    return qk_norm_rope_launch(qk, q_weight, k_weight, eps, cos, sin, num_q_heads)


def qk_norm_rope_launch(qk, q_weight, k_weight, eps, cos, sin, num_q_heads):
    """The Triton path of ``qk_norm_rope`` (also what the interpreter tests call on CPU tensors)."""
    T, H, D = qk.shape
    out = torch.empty(T, H, D, dtype=qk.dtype, device=qk.device)
    if T and H:
        rope = cos is not None
        BLOCK_H = min(triton.next_power_of_2(H), 8)
        _qk_norm_rope_kernel[(T, triton.cdiv(H, BLOCK_H))](
            qk, q_weight, k_weight, cos if rope else qk, sin if rope else qk, out, num_q_heads, H, float(eps),
            qk.stride(0), qk.stride(1), cos.stride(0) if rope else 0, D=D, HALF=D // 2, BLOCK_H=BLOCK_H,
            BLOCK_D=triton.next_power_of_2(D // 2), ROPE=rope, **pdl.launch(qk.device))
    return out[:, :num_q_heads], out[:, num_q_heads:]
