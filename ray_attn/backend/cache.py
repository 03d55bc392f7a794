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


def as_fp8_cache(cache: torch.Tensor) -> torch.Tensor:
    """A float8 view of an fp8 cache.  vLLM allocates fp8 caches as uint8 and views them as float8
    around each kernel; every write and read here goes through the float8 view, because storing a
    float into a uint8 tensor converts it to an integer instead of rounding it to e4m3."""
    return cache.view(FP8_DTYPE) if cache.dtype == torch.uint8 else cache


def scale_tensor(scale, device) -> torch.Tensor:
    """A float32 one-element tensor on ``device`` for a float or tensor scale."""
    if isinstance(scale, torch.Tensor):
        scale = scale.reshape(1)
        return scale if scale.dtype == torch.float32 and scale.device == device else scale.to(device, torch.float32)
    return torch.tensor([float(scale)], dtype=torch.float32, device=device)


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

    ``slot_mapping`` is int32 (our planner) or int64 (vLLM's), read as it is.  Negative slots are
    skipped, as vLLM's write skips them: vLLM pads its slot mapping with -1 (``PAD_SLOT_ID``).  With an fp8
    ``kv_cache_dtype`` the values are divided by ``k_scale``/``v_scale`` (floats or one-element
    tensors, as on vLLM's layers) and rounded to e4m3; the caches may be float8 or uint8.
    """
    fp8 = is_fp8_kv_cache(kv_cache_dtype)
    if fp8:
        key_cache, value_cache = as_fp8_cache(key_cache), as_fp8_cache(value_cache)
    if key.is_cuda:
        from ray_attn.backend import triton_ops

        if triton_ops.available():
            # One kernel that skips -1 slots on the GPU: no boolean mask, so no host sync.
            ks = scale_tensor(k_scale, key.device) if fp8 else None
            vs = scale_tensor(v_scale, key.device) if fp8 else None
            triton_ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, fp8, ks, vs)
            return
    flat_k = key_cache.view(-1, *key_cache.shape[2:])
    flat_v = value_cache.view(-1, *value_cache.shape[2:])
    slots = slot_mapping.long()  # index_copy_ wants int64; a no-op for vLLM's int64 slots
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    if fp8:
        ks, vs = scale_tensor(k_scale, key.device), scale_tensor(v_scale, key.device)
        # Index-copy the raw bytes: not every CPU kernel is implemented for float8 dtypes.
        flat_k.view(torch.uint8).index_copy_(0, slots, quantize_fp8(key, ks).view(torch.uint8))
        flat_v.view(torch.uint8).index_copy_(0, slots, quantize_fp8(value, vs).view(torch.uint8))
    else:
        flat_k.index_copy_(0, slots, key.to(flat_k.dtype))
        flat_v.index_copy_(0, slots, value.to(flat_v.dtype))
