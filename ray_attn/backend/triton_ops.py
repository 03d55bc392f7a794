"""Fused GPU versions of the two small ops around the attention kernel.

Why: the torch versions of ``reshape_and_cache_flash`` must drop the -1 slots with a boolean mask,
which syncs the host with the GPU once per layer, and ``merge_attn_states`` in torch is ~10
elementwise kernels.  Each is one Triton kernel here.  Used only on CUDA when Triton imports.
"""

from __future__ import annotations

import functools

import torch

from ray_attn.backend import pdl
try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - CPU machines without triton
    triton = None


@functools.cache
def available() -> bool:
    return triton is not None and torch.cuda.is_available()


if triton is not None:

    @triton.jit
    def _cache_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, k_stride, v_stride, k_scale_ptr,
                      v_scale_ptr, N: tl.constexpr, BLOCK: tl.constexpr, FP8: tl.constexpr, USE_PDL: tl.constexpr):
        if USE_PDL:  # pdl.py: nothing an earlier kernel writes is read before the wait
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            offs = tl.arange(0, BLOCK)
            mask = offs < N
            k = tl.load(k_ptr + t * k_stride + offs, mask=mask)
            v = tl.load(v_ptr + t * v_stride + offs, mask=mask)
            if FP8:
                # Scales are read on the device: they may be computed there (calculate_kv_scales)
                # and a captured graph must see their current value.
                k = tl.clamp(k.to(tl.float32) / tl.load(k_scale_ptr), -448.0, 448.0)
                v = tl.clamp(v.to(tl.float32) / tl.load(v_scale_ptr), -448.0, 448.0)
            tl.store(kc_ptr + slot * N + offs, k.to(kc_ptr.dtype.element_ty), mask=mask)
            tl.store(vc_ptr + slot * N + offs, v.to(vc_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _merge_kernel(out_ptr, p_ptr, p_lse_ptr, s_ptr, s_lse_ptr, T, D: tl.constexpr,
                      BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr):
        if USE_PDL:  # pdl.py: nothing an earlier kernel writes is read before the wait
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        t = tl.program_id(0)
        h = tl.program_id(1)
        H = tl.num_programs(1)
        p_lse = tl.load(p_lse_ptr + h * T + t)
        s_lse = tl.load(s_lse_ptr + h * T + t)
        p_lse = tl.where(p_lse == float("inf"), float("-inf"), p_lse)
        s_lse = tl.where(s_lse == float("inf"), float("-inf"), s_lse)
        m = tl.maximum(p_lse, s_lse)
        m = tl.where(m == float("-inf"), 0.0, m)
        pw = tl.exp(p_lse - m)
        sw = tl.exp(s_lse - m)
        total = pw + sw
        total = tl.where(total == 0.0, 1.0, total)
        offs = tl.arange(0, BLOCK_D)
        mask = offs < D
        base = (t * H + h) * D
        p = tl.load(p_ptr + base + offs, mask=mask).to(tl.float32)
        s = tl.load(s_ptr + base + offs, mask=mask).to(tl.float32)
        o = (p * pw + s * sw) / total
        # An empty prefix gives the suffix's own values, whatever its output holds: batch-invariant
        # cascade (planner/invariant.py) relies on a row below the first grid line keeping the bits
        # of a plain pass.
        o = tl.where((p_lse == float("-inf")) & (s_lse != float("-inf")), s, o)
        tl.store(out_ptr + base + offs, o.to(out_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, fp8: bool,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """``k_scale``/``v_scale``: float32 device tensors of one element (fp8 only).  With ``fp8``
    the caches must be float8_e4m3fn: the store converts to the cache's element type, and into a
    uint8 cache that would be an integer conversion, not fp8 rounding."""
    T = slot_mapping.shape[0]
    if T == 0:
        return
    N = key.shape[1] * key.shape[2]
    assert key.stride(2) == 1 and key.stride(1) == key.shape[2], "rows of key must be contiguous"
    assert value.stride(2) == 1 and value.stride(1) == value.shape[2]
    if fp8:
        assert key_cache.dtype == value_cache.dtype == torch.float8_e4m3fn, key_cache.dtype
    else:
        k_scale = v_scale = slot_mapping  # unused pointers: FP8 is a compile-time branch
    _cache_kernel[(T,)](key, value, key_cache, value_cache, slot_mapping, key.stride(0),
                        value.stride(0), k_scale, v_scale, N=N,
                        BLOCK=triton.next_power_of_2(N), FP8=fp8, **pdl.launch(key.device))


def merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse) -> None:
    T, H, D = output.shape
    assert output.is_contiguous() and prefix_output.is_contiguous() and suffix_output.is_contiguous()
    _merge_kernel[(T, H)](output, prefix_output, prefix_lse.contiguous(), suffix_output,
                          suffix_lse.contiguous(), T, D=D, BLOCK_D=triton.next_power_of_2(D),
                          **pdl.launch(output.device))
