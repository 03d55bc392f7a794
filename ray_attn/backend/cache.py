"""Writing new K/V into the paged cache, with optional fp8 (e4m3) quantisation."""

from __future__ import annotations

import torch

FP8_KV_DTYPES = ("fp8", "fp8_e4m3")
FP8_DTYPE = torch.float8_e4m3fn


def is_fp8_kv_cache(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype in FP8_KV_DTYPES


def quantize_fp8(x: torch.Tensor, scale) -> torch.Tensor:
    """Scale into e4m3's range, saturating rather than producing NaN for outliers."""
    finfo = torch.finfo(FP8_DTYPE)
    return (x.float() / scale).clamp(finfo.min, finfo.max).to(FP8_DTYPE)


def _as_float(scale) -> torch.Tensor | float:
    return scale if not isinstance(scale, torch.Tensor) else scale.float()


def reshape_and_cache_flash(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    k_scale=1.0,
    v_scale=1.0,
) -> None:
    """Store ``key``/``value`` [T, Hk, D] at flat slots ``block * block_size + offset``.

    Slots of -1 are skipped (padding tokens); the caller passes only the real tokens.
    """
    if key.is_cuda:
        from ray_attn.backend import triton_ops

        if triton_ops.available():
            # One kernel that skips -1 slots on the GPU: no boolean mask, so no host sync.
            triton_ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                                         is_fp8_kv_cache(kv_cache_dtype), float(k_scale), float(v_scale))
            return
    flat_k = key_cache.view(-1, *key_cache.shape[2:])
    flat_v = value_cache.view(-1, *value_cache.shape[2:])
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    if is_fp8_kv_cache(kv_cache_dtype):
        # Index-copy the raw bytes: not every CPU kernel is implemented for float8 dtypes.
        flat_k.view(torch.uint8).index_copy_(0, slots, quantize_fp8(key, _as_float(k_scale)).view(torch.uint8))
        flat_v.view(torch.uint8).index_copy_(0, slots, quantize_fp8(value, _as_float(v_scale)).view(torch.uint8))
    else:
        flat_k.index_copy_(0, slots, key.to(flat_k.dtype))
        flat_v.index_copy_(0, slots, value.to(flat_v.dtype))
