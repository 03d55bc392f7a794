"""Kernel dispatch: which attention kernel runs a layer, and one calling convention for all three.

Every kernel exposes ``varlen_paged(...) -> lse | None`` over the same arguments, so that the
backend's plain, local and cascade paths are written once.  The choice is made per layer
configuration by :func:`select_kernel`; a config may name a kernel, and then an unsupported
configuration is an error that says why instead of a silent fallback.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ray_attn.backend import batch_invariant, cpu_decode
from ray_attn.backend.cache import FP8_DTYPE, is_fp8_kv_cache, quantize_fp8
from ray_attn.backend.reference import paged_attention_ref

KERNEL_NAMES = ("fa3", "fa2", "torch")
FA2_BLOCK_MULTIPLE = 256  # upstream flash-attn 2: "Paged KV cache block size must be divisible by 256"
FA3_HEAD_SIZES = (64, 128)  # what the FlashAttention 3 build in our GPU kit covers


@dataclass(frozen=True)
class LayerKernelSpec:
    """What a kernel must support to run one layer."""

    head_size: int
    dtype: torch.dtype
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    use_alibi: bool = False


@functools.cache
def _has_module(name: str) -> bool:
    try:
        __import__(name)
        return True
    except Exception:  # a broken CUDA install raises more than ImportError
        return False


def _is_hopper(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def unsupported_reason(kernel: str, spec: LayerKernelSpec, device: torch.device | None = None) -> str | None:
    """Why ``kernel`` cannot run ``spec`` (None if it can).  ``device=None`` checks the static
    rules only, which is what a driver without GPUs can do before any actor starts."""
    fp8 = is_fp8_kv_cache(spec.kv_cache_dtype)
    if kernel == "torch":
        return None
    if kernel == "fa2":
        if spec.block_size % FA2_BLOCK_MULTIPLE:
            return (f"flash-attn 2 paged KV needs block_size % {FA2_BLOCK_MULTIPLE} == 0, got "
                    f"block_size={spec.block_size}; use block_size=256, or kernel='fa3'")
        if fp8:
            return f"flash-attn 2 has no fp8 KV cache (kv_cache_dtype={spec.kv_cache_dtype!r})"
        if spec.dtype not in (torch.float16, torch.bfloat16):
            return f"flash-attn 2 runs float16/bfloat16 only, got dtype={spec.dtype}"
        if device is not None and (device.type != "cuda" or not _has_module("flash_attn")):
            return f"flash-attn 2 needs CUDA and the flash_attn package (device={device})"
        return None
    if kernel == "fa3":
        if spec.head_size not in FA3_HEAD_SIZES:
            return f"FlashAttention 3 (this build) supports head sizes {FA3_HEAD_SIZES}, got {spec.head_size}"
        if spec.use_alibi:
            return "FlashAttention 3 has no ALiBi"
        if spec.dtype != torch.bfloat16:
            return f"FlashAttention 3 (this build) runs bfloat16 (or an fp8 KV cache), got dtype={spec.dtype}"
        if device is not None and not (_is_hopper(device) and _has_module("flash_attn_interface")):
            return f"FlashAttention 3 needs a Hopper GPU and flash_attn_interface (device={device})"
        return None
    raise ValueError(f"unknown kernel {kernel!r}; choose one of {KERNEL_NAMES} or 'auto'")


def select_kernel(spec: LayerKernelSpec, device: torch.device, override: str = "auto") -> "Kernel":
    """The fastest kernel that can run ``spec`` on ``device``, or exactly ``override``."""
    device = torch.device(device)
    if override != "auto":
        reason = unsupported_reason(override, spec, device)
        if reason:
            raise ValueError(f"kernel={override!r} cannot run this layer: {reason}")
        return _KERNELS[override]()
    for name in KERNEL_NAMES:
        if unsupported_reason(name, spec, device) is None:
            return _KERNELS[name]()
    raise AssertionError("the torch kernel supports everything")


class Kernel:
    """``num_splits`` (FlashAttention 3 only; 0 = the kernel's own heuristic) splits each row's
    KV range over several CTAs; other kernels ignore it."""

    name: str = ""
    # FlashAttention 3 multiplies fp8 q/k/v by descales in-kernel and wants q in fp8 as well.
    quantizes_query: bool = False

    def varlen_paged(self, q, k_cache, v_cache, out, *, cu_seqlens_q, max_seqlen_q, seqused_k,
                     max_seqlen_k, block_table, scale, causal, window_size=(-1, -1),
                     alibi_slopes=None, softcap=0.0, q_descale=None, k_descale=None,
                     v_descale=None, scheduler_metadata=None, return_lse=False, num_splits=0):
        raise NotImplementedError

    def scheduler_metadata(self, **kwargs):
        """Ahead-of-time split/tile plan for one step (FlashAttention 3 only)."""
        return None

    uses_scheduler_metadata = False


class TorchKernel(Kernel):
    name = "torch"

    def varlen_paged(self, q, k_cache, v_cache, out, *, cu_seqlens_q, max_seqlen_q, seqused_k,
                     max_seqlen_k, block_table, scale, causal, window_size=(-1, -1),
                     alibi_slopes=None, softcap=0.0, q_descale=None, k_descale=None,
                     v_descale=None, scheduler_metadata=None, return_lse=False, num_splits=0):
        # float64 inputs (the tests' oracle mode) are computed in float64, all else in float32.
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        if cpu_decode.supports(q, k_cache, cu_seqlens_q, max_seqlen_q, alibi_slopes, compute, causal):
            _, lse = cpu_decode.paged_decode(  # decode or verification, batched (the loop's per-op cost)
                q, k_cache, v_cache, seqused_k=seqused_k, block_table=block_table, scale=scale,
                window_size=window_size, softcap=softcap, k_descale=_scalar(k_descale),
                v_descale=_scalar(v_descale), out=out, return_lse=return_lse,
                cu_seqlens_q=cu_seqlens_q if max_seqlen_q > 1 else None, max_seqlen_q=max_seqlen_q,
                plans=scheduler_metadata if isinstance(scheduler_metadata, dict) and not q.is_cuda else None)
            return lse if return_lse else None
        _, lse = paged_attention_ref(
            q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k,
            block_table=block_table, scale=scale, causal=causal, window_size=window_size,
            alibi_slopes=alibi_slopes, softcap=softcap,
            k_descale=_scalar(k_descale), v_descale=_scalar(v_descale), out=out,
            compute_dtype=compute)
        return lse if return_lse else None

    # The step's plan here is a cache for ``cpu_decode``'s gather indices and masks: the
    # metadata object keeps it (``FlashAttentionImpl._scheduler_metadata``), so the ~15 small
    # ops that derive them run once a step, not once per layer.  CPU only: a CUDA graph's
    # metadata outlives its step.
    uses_scheduler_metadata = True

    def scheduler_metadata(self, **kwargs):
        return {}


def _scalar(x) -> float:
    if x is None:
        return 1.0
    return float(x.flatten()[0]) if isinstance(x, torch.Tensor) else float(x)


class FlashAttn2Kernel(Kernel):
    """Upstream flash-attn 2: paged KV through ``flash_attn_varlen_func(block_table=...)``."""

    name = "fa2"

    def varlen_paged(self, q, k_cache, v_cache, out, *, cu_seqlens_q, max_seqlen_q, seqused_k,
                     max_seqlen_k, block_table, scale, causal, window_size=(-1, -1),
                     alibi_slopes=None, softcap=0.0, q_descale=None, k_descale=None,
                     v_descale=None, scheduler_metadata=None, return_lse=False, num_splits=0):
        from flash_attn import flash_attn_varlen_func

        # Upstream takes cumulative key lengths, not per-sequence lengths; with a block table it
        # reads only their differences, so a cumsum of seqused_k is exact.
        cu_seqlens_k = torch.nn.functional.pad(seqused_k.cumsum(0, dtype=torch.int32), (1, 0))
        if return_lse and max_seqlen_q == 1:
            # For single-token GQA queries upstream folds the query heads into the sequence axis
            # and then reshapes the LSE without undoing the fold, scrambling it.  An upper bound
            # of 2 is still a valid max_seqlen_q and keeps the LSE in [heads, tokens] order.
            max_seqlen_q = 2
        res = flash_attn_varlen_func(
            q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            softmax_scale=scale, causal=causal, window_size=window_size, softcap=softcap,
            alibi_slopes=alibi_slopes, return_attn_probs=return_lse, block_table=block_table)
        o, lse = (res[0], res[1]) if return_lse else (res, None)
        out.copy_(o)
        return lse


class FlashAttn3Kernel(Kernel):
    """FlashAttention 3 (Hopper): paged KV with a page table, any page size, fp8 descales.

    We call the compiled op directly rather than ``flash_attn_with_kvcache``: the Python custom-op
    wrapper costs ~0.35 ms of host time per call (32 layers: ~11 ms a decode step, more than the
    GPU needs) and cannot write into our output buffer.  If the op's signature differs from the
    one we know, we fall back to the public API once and for all.
    """

    name = "fa3"
    quantizes_query = True
    # Ahead-of-time tile/split plans (``scheduler_metadata()``): one prepare kernel per step
    # instead of one per layer.  The plan must be built with the call's causal flag (a
    # mismatch segfaults: tests/backend/test_fa3_aot.py).
    uses_scheduler_metadata = True
    _raw_ok: bool | None = None

    def varlen_paged(self, q, k_cache, v_cache, out, *, cu_seqlens_q, max_seqlen_q, seqused_k,
                     max_seqlen_k, block_table, scale, causal, window_size=(-1, -1),
                     alibi_slopes=None, softcap=0.0, q_descale=None, k_descale=None,
                     v_descale=None, scheduler_metadata=None, return_lse=False, num_splits=0):
        if alibi_slopes is not None:
            raise NotImplementedError("FlashAttention 3 has no ALiBi; use kernel='fa2' or 'torch'")
        # FA3 wants one descale per (sequence, kv head); a per-layer scale broadcasts (stride 0).
        shape = (cu_seqlens_q.shape[0] - 1, k_cache.shape[-2])
        q_descale, k_descale, v_descale = (None if d is None else d.expand(shape)
                                           for d in (q_descale, k_descale, v_descale))
        window_size = fa3_window(window_size, max_seqlen_q, max_seqlen_k)
        num_splits = one_split_if_invariant(num_splits)
        if FlashAttn3Kernel._raw_ok is not False:
            try:
                lse = self._raw(q, k_cache, v_cache, out, cu_seqlens_q, max_seqlen_q, seqused_k,
                                max_seqlen_k, block_table, scale, causal, window_size, softcap, q_descale,
                                k_descale, v_descale, scheduler_metadata, num_splits)
                FlashAttn3Kernel._raw_ok = True
                return lse if return_lse else None
            except (TypeError, AttributeError, RuntimeError):
                if FlashAttn3Kernel._raw_ok:
                    raise  # it worked before: this is a real error, not a signature mismatch
                FlashAttn3Kernel._raw_ok = False
        from flash_attn_interface import flash_attn_with_kvcache

        res = flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seqused_k, page_table=block_table,
            cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, softmax_scale=scale,
            causal=causal, window_size=window_size, softcap=softcap, q_descale=q_descale,
            k_descale=k_descale, v_descale=v_descale, scheduler_metadata=scheduler_metadata,
            return_softmax_lse=return_lse, num_splits=num_splits)
        o, lse = (res[0], res[1]) if return_lse else (res, None)
        out.copy_(o)
        return lse

    @staticmethod
    def _raw(q, k_cache, v_cache, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k,
             block_table, scale,
             causal, window_size, softcap, q_descale, k_descale, v_descale, scheduler_metadata,
             num_splits=0, pack_gqa=None):
        from flash_attn_interface import flash_attn_3_gpu

        o, lse, *_ = flash_attn_3_gpu.fwd(
            q, k_cache, v_cache, None, None, None, out, cu_seqlens_q, None, None, None, seqused_k,
            max_seqlen_q, max_seqlen_k, block_table, None, None, None, None, None, q_descale, k_descale,
            v_descale, scale, causal, window_size[0], window_size[1], 0, softcap, True,
            scheduler_metadata, num_splits, pack_gqa, 0)
        if o.data_ptr() != out.data_ptr():
            out.copy_(o)
        return lse

    def scheduler_metadata(self, *, batch_size, max_seqlen_q, max_seqlen_k, num_heads_q,
                           num_heads_kv, head_size, cache_seqlens, qkv_dtype, cu_seqlens_q,
                           page_size, causal, window_size, has_softcap, num_splits=0):
        from flash_attn_interface import get_scheduler_metadata

        window_size = fa3_window(window_size, max_seqlen_q, max_seqlen_k)
        num_splits = one_split_if_invariant(num_splits)  # the plan and the call agree on it
        return get_scheduler_metadata(
            batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, head_size,
            cache_seqlens, qkv_dtype=qkv_dtype, cu_seqlens_q=cu_seqlens_q, page_size=page_size,
            causal=causal, window_size=window_size, has_softcap=has_softcap, num_splits=num_splits)


def one_split_if_invariant(num_splits: int) -> int:
    """FA3's split count picks itself from the batch (0) or the decode graph's size; a row's
    softmax then merges a different number of partial states in a plain step and in a verifying
    one.  ``batch_invariant`` mode runs every row over its whole KV in one CTA."""
    return 1 if batch_invariant.enabled() else num_splits


def fa3_window(window_size: tuple[int, int], max_seqlen_q: int, max_seqlen_k: int) -> tuple[int, int]:
    """A window that cannot clip anything, as no window.  FA3's forward makes this change itself
    but its ``get_scheduler_metadata`` does not, and a plan built for a local (windowed) call
    handed to a causal one crashes the process; normalising both sides keeps them in step."""
    left, right = window_size
    if left >= max_seqlen_k - 1:
        left = -1
    if right >= max_seqlen_q - 1:
        right = -1
    return left, right


_KERNELS = {"torch": TorchKernel, "fa2": FlashAttn2Kernel, "fa3": FlashAttn3Kernel}


def normalize_lse(lse: torch.Tensor, num_heads: int, num_tokens: int) -> torch.Tensor:
    """LSE as [num_heads, num_tokens], whatever layout the kernel returned it in."""
    if lse.shape == (num_heads, num_tokens):
        return lse
    if lse.dim() == 2 and lse.shape == (num_tokens, num_heads):
        return lse.t()
    raise ValueError(f"unexpected LSE shape {tuple(lse.shape)} for {num_heads} heads x {num_tokens} tokens")


def fp8_query(q: torch.Tensor, q_scale) -> torch.Tensor:
    return quantize_fp8(q, q_scale if not isinstance(q_scale, torch.Tensor) else q_scale.float())


__all__ = ["KERNEL_NAMES", "LayerKernelSpec", "select_kernel", "unsupported_reason", "Kernel",
           "TorchKernel", "FlashAttn2Kernel", "FlashAttn3Kernel", "normalize_lse", "fp8_query",
           "FP8_DTYPE"]
