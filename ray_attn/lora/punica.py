"""Batched LoRA for a step that mixes adapters: shrink ``S = x A[slot]^T`` then expand
``y += S B[slot]^T``, over weights stacked by slot (``A [L, P*R, K]``, ``B [L, N, R]``).

A fused projection (q/k/v, gate/up) carries one adapter part per checkpoint projection: its P
parts' A rows sit one after another (``S``'s columns ``p*R .. (p+1)*R``), and its B rows are the
projection's own output rows, so output column n reads part ``p(n)`` (``part_offsets``) of S.
B is stored pre-multiplied by the module's scaling (as vLLM's ``optimize``), so the expand is one
product.  Tokens of the base model have slot -1 and are not touched.

Which tokens each slot has travels as a step's metadata (``LoRAStepMeta``, built once per step
on the rank from the plan's per-row slots): the tokens sorted by slot and each slot's start in
that order (SGMV's segments).  On CUDA the Triton kernels (a shrink and an expand, or for steps
of few tokens one fused kernel, as ``tuning.py`` picks per device and shape) read it on the
device, with a grid fixed by the token count and ``max_loras`` -- programs of an empty segment
return at once -- so a decode step replays from a CUDA graph whatever its adapters: the slot is an input,
never a branch.  On CPU (and for the tests' reference) a loop over the slots present runs the same
math in torch.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch

from ray_attn.backend.triton_ops import available
from ray_attn.lora import tuning
from ray_attn.lora.tuning import KernelConfig

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - machines without triton
    triton = None

BLOCK_M = 16  # tl.dot's smallest tile
# Split-K for the shrink at decode sizes: with a handful of tokens the grid has one program per
# (slot, 16 tokens, 64 columns of S), and each would walk all of K (4,096-14,336) alone -- one SM
# reading A serially, ~10x longer than the expand.  Up to ``max_split`` programs each take a slice
# of K (``split_min_k`` at least) and write a float32 partial of S; the expand sums the partials as
# it loads S, so the result is deterministic (no atomics) and no extra kernel runs.  The settings
# are per device and shape (``tuning.py``).
MAX_SPLIT, SPLIT_MAX_TOKENS = tuning.MAX_SPLIT, tuning.SPLIT_MAX_TOKENS


def split_k(num_tokens: int, K: int, cfg: KernelConfig = tuning.DEFAULT) -> int:
    """How many K-slices the shrink of ``num_tokens`` tokens runs in (1: none)."""
    if num_tokens > SPLIT_MAX_TOKENS:
        return 1
    return max(1, min(cfg.max_split, K // cfg.split_min_k))


def scratch_elems(capacity: int, width: int) -> int:
    """Float32 elements of a shrink scratch that serves any step of up to ``capacity`` tokens and
    S ``width`` columns wide, split or not (a graph captures its address: sized once)."""
    return width * max(capacity, SPLIT_MAX_TOKENS * MAX_SPLIT)


def step_meta(token_slots: np.ndarray, max_loras: int) -> tuple[np.ndarray, np.ndarray]:
    """The step's tokens of each slot, in slot order (base tokens left out), and each slot's
    start in that order (``[max_loras + 1]``: slot l's tokens are ``sorted[start[l]:start[l+1]]``)."""
    ts = np.asarray(token_slots)
    order = np.argsort(ts, kind="stable")
    order = order[ts[order] >= 0]
    counts = np.bincount(ts[order], minlength=max_loras)[:max_loras]
    return order.astype(np.int32), np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)


def lora_reference(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, offsets: tuple[int, ...],
                   rank: int, token_slots: torch.Tensor) -> torch.Tensor:
    """``y`` plus each token's adapter update, in the activations' dtype (torch; data-dependent
    shapes, so not for CUDA graphs).  ``token_slots`` [>= T]: the first T are x's tokens'."""
    slots = token_slots[: x.shape[0]]
    bounds = list(offsets) + [y.shape[1]]
    for s in torch.unique(slots).tolist():
        if s < 0:
            continue
        idx = (slots == s).nonzero().squeeze(1)
        shrunk = x[idx] @ a[s].t().to(x.dtype)  # [n, P*R]
        for p in range(len(offsets)):
            lo, hi = bounds[p], bounds[p + 1]
            y[idx, lo:hi] += shrunk[:, p * rank:(p + 1) * rank] @ b[s, lo:hi].t().to(x.dtype)
    return y


if triton is not None:

    @triton.jit
    def _shrink_kernel(x_ptr, a_ptr, s_ptr, sorted_ptr, start_ptr, K, RT, x_stride, a_slot_stride, a_row_stride,
                       s_stride, split_stride, k_per, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        slot = tl.program_id(2) // SPLIT
        part = tl.program_id(2) % SPLIT  # this program's slice of K: [part * k_per, +k_per)
        begin = tl.load(start_ptr + slot)
        end = tl.load(start_ptr + slot + 1)
        m0 = begin + pid_m * BLOCK_M
        if m0 < end:
            rm = m0 + tl.arange(0, BLOCK_M)
            mmask = rm < end
            tok = tl.load(sorted_ptr + rm, mask=mmask, other=0).to(tl.int64)
            rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            nmask = rn < RT
            rk = tl.arange(0, BLOCK_K)
            a_base = a_ptr + slot.to(tl.int64) * a_slot_stride
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            k_lo = part * k_per
            k_hi = tl.minimum(k_lo + k_per, K)
            for k in range(k_lo, k_hi, BLOCK_K):
                kmask = (k + rk) < k_hi
                xt = tl.load(x_ptr + tok[:, None] * x_stride + (k + rk)[None, :],
                             mask=mmask[:, None] & kmask[None, :], other=0.0)
                at = tl.load(a_base + rn[None, :] * a_row_stride + (k + rk)[:, None],
                             mask=nmask[None, :] & kmask[:, None], other=0.0)
                acc += tl.dot(xt, at.to(xt.dtype), input_precision=PRECISION)
            tl.store(s_ptr + part.to(tl.int64) * split_stride + tok[:, None] * s_stride + rn[None, :], acc,
                     mask=mmask[:, None] & nmask[None, :])

    @triton.jit
    def _expand_kernel(s_ptr, b_ptr, y_ptr, sorted_ptr, start_ptr, N, off1, off2, s_stride, split_stride,
                       b_slot_stride, b_row_stride, y_stride, SPLIT: tl.constexpr, R: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       PRECISION: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        slot = tl.program_id(2)
        begin = tl.load(start_ptr + slot)
        end = tl.load(start_ptr + slot + 1)
        m0 = begin + pid_m * BLOCK_M
        if m0 < end:
            rm = m0 + tl.arange(0, BLOCK_M)
            mmask = rm < end
            tok = tl.load(sorted_ptr + rm, mask=mmask, other=0).to(tl.int64)
            n0 = pid_n * BLOCK_N
            rn = n0 + tl.arange(0, BLOCK_N)
            nmask = rn < N
            part = (n0 >= off1).to(tl.int32) + (n0 >= off2).to(tl.int32)  # the block lies in one part
            rr = tl.arange(0, R)
            s_rows = s_ptr + tok[:, None] * s_stride + part * R + rr[None, :]
            st = tl.load(s_rows, mask=mmask[:, None], other=0.0)
            for sp in tl.static_range(1, SPLIT):  # the shrink's K-slices, summed in a fixed order
                st += tl.load(s_rows + sp * split_stride, mask=mmask[:, None], other=0.0)
            bt = tl.load(b_ptr + slot.to(tl.int64) * b_slot_stride + rn[None, :] * b_row_stride + rr[:, None],
                         mask=nmask[None, :], other=0.0)
            acc = tl.dot(st.to(bt.dtype), bt, input_precision=PRECISION)
            ptrs = y_ptr + tok[:, None] * y_stride + rn[None, :]
            mask = mmask[:, None] & nmask[None, :]
            y = tl.load(ptrs, mask=mask, other=0.0)
            tl.store(ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


    @triton.jit
    def _fused_kernel(x_ptr, a_ptr, b_ptr, y_ptr, sorted_ptr, start_ptr, K, N, off1, off2, x_stride, a_slot_stride,
                      a_row_stride, b_slot_stride, b_row_stride, y_stride, R: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
        # one program: BLOCK_N columns of y for one slot's tokens.  It computes the shrink of the
        # one part its columns lie in (R rows of A, from L2 after the first program reads them) and
        # expands it at once: one launch where two would run, for steps of few tokens per slot.
        pid_n = tl.program_id(0)
        slot = tl.program_id(1)
        begin = tl.load(start_ptr + slot)
        end = tl.load(start_ptr + slot + 1)
        if begin < end:
            n0 = pid_n * BLOCK_N
            rn = n0 + tl.arange(0, BLOCK_N)
            nmask = rn < N
            part = (n0 >= off1).to(tl.int32) + (n0 >= off2).to(tl.int32)
            rr = tl.arange(0, R)
            rk = tl.arange(0, BLOCK_K)
            a_rows = a_ptr + slot.to(tl.int64) * a_slot_stride + (part * R + rr)[None, :] * a_row_stride
            bt = tl.load(b_ptr + slot.to(tl.int64) * b_slot_stride + rn[None, :] * b_row_stride + rr[:, None],
                         mask=nmask[None, :], other=0.0)
            for m0 in range(begin, end, BLOCK_M):
                rm = m0 + tl.arange(0, BLOCK_M)
                mmask = rm < end
                tok = tl.load(sorted_ptr + rm, mask=mmask, other=0).to(tl.int64)
                s = tl.zeros((BLOCK_M, R), dtype=tl.float32)
                for k in range(0, K, BLOCK_K):
                    kmask = (k + rk) < K
                    xt = tl.load(x_ptr + tok[:, None] * x_stride + (k + rk)[None, :],
                                 mask=mmask[:, None] & kmask[None, :], other=0.0)
                    at = tl.load(a_rows + (k + rk)[:, None], mask=kmask[:, None], other=0.0)
                    s += tl.dot(xt, at.to(xt.dtype), input_precision=PRECISION)
                acc = tl.dot(s.to(bt.dtype), bt, input_precision=PRECISION)
                ptrs = y_ptr + tok[:, None] * y_stride + rn[None, :]
                mask = mmask[:, None] & nmask[None, :]
                y = tl.load(ptrs, mask=mask, other=0.0)
                tl.store(ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=None)
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def expand_block(offsets: tuple[int, ...], widest: int = 64) -> int | None:
    """The widest tile of columns (a power of two, ``widest`` down to 16) that no part boundary
    cuts; None: none."""
    bn = widest
    while bn >= 16:
        if all(o % bn == 0 for o in offsets):
            return bn
        bn //= 2
    return None


class Launch(NamedTuple):
    """One projection's launch settings for a step: the tuned config, the expand's column tile and
    the shrink's K-split."""
    config: KernelConfig
    block_n: int
    split: int


def plan_launch(x: torch.Tensor, a: torch.Tensor, N: int, offsets: tuple[int, ...], rank: int,
                block_n: int | None = None, config: KernelConfig | None = None) -> Launch:
    """The settings ``lora_triton`` (or ``shrink`` then ``expand``) runs x's step with."""
    T, K = x.shape
    if config is None:
        config = tuning.config_for(_device_name(x.device) if x.is_cuda else None, T, K, N, len(offsets), rank)
    bn = block_n or expand_block(offsets[1:], config.block_n)
    if bn is None:
        raise ValueError(f"lora_triton: part offsets {offsets} are not multiples of 16")
    return Launch(config, bn, 1 if config.fused else split_k(T, K, config))


def _precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


def shrink(launch: Launch, x: torch.Tensor, a: torch.Tensor, shrunk: torch.Tensor, sorted_tokens: torch.Tensor,
           seg_start: torch.Tensor) -> None:
    """``S = x A[slot]^T`` into ``shrunk`` (``launch.split`` float32 partials of [T, P*R])."""
    T, K = x.shape
    L, RT, _ = a.shape
    cfg, split = launch.config, launch.split
    if shrunk.dtype != torch.float32 or shrunk.numel() < split * T * RT:
        raise ValueError(f"lora_triton: the scratch needs {split * T * RT} float32 elements, got "
                         f"{shrunk.numel()} {shrunk.dtype}")
    bn_shrink = min(64, triton.next_power_of_2(RT))
    block_k = cfg.block_k if K >= cfg.block_k else 16
    k_per = triton.cdiv(triton.cdiv(K, split), block_k) * block_k  # slices whole tiles of K
    _shrink_kernel[(triton.cdiv(T, BLOCK_M), triton.cdiv(RT, bn_shrink), L * split)](
        x, a, shrunk, sorted_tokens, seg_start, K, RT, x.stride(0), a.stride(0), a.stride(1), RT, T * RT, k_per,
        SPLIT=split, BLOCK_M=BLOCK_M, BLOCK_N=bn_shrink, BLOCK_K=block_k, PRECISION=_precision(x),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def expand(launch: Launch, shrunk: torch.Tensor, b: torch.Tensor, y: torch.Tensor, offsets: tuple[int, ...],
           rank: int, sorted_tokens: torch.Tensor, seg_start: torch.Tensor) -> torch.Tensor:
    """``y += S B[slot]^T`` (in place), S summed over the shrink's partials."""
    T, N = y.shape
    L, RT = b.shape[0], len(offsets) * rank
    off = list(offsets[1:]) + [N] * (3 - len(offsets))
    _expand_kernel[(triton.cdiv(T, BLOCK_M), triton.cdiv(N, launch.block_n), L)](
        shrunk, b, y, sorted_tokens, seg_start, N, off[0], off[1], RT, T * RT, b.stride(0), b.stride(1),
        y.stride(0), SPLIT=launch.split, R=rank, BLOCK_M=BLOCK_M, BLOCK_N=launch.block_n,
        PRECISION=_precision(y), num_warps=launch.config.expand_warps)
    return y


def fused(launch: Launch, x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
          offsets: tuple[int, ...], rank: int, sorted_tokens: torch.Tensor, seg_start: torch.Tensor) -> torch.Tensor:
    """Shrink and expand in one kernel (in place on ``y``)."""
    K, N, L = x.shape[1], y.shape[1], a.shape[0]
    cfg, bn = launch.config, launch.block_n
    off = list(offsets[1:]) + [N] * (3 - len(offsets))
    _fused_kernel[(triton.cdiv(N, bn), L)](
        x, a, b, y, sorted_tokens, seg_start, K, N, off[0], off[1], x.stride(0), a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), y.stride(0), R=rank, BLOCK_M=BLOCK_M, BLOCK_N=bn,
        BLOCK_K=min(cfg.block_k, max(16, triton.next_power_of_2(K))), PRECISION=_precision(x),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y


def check_strides(x: torch.Tensor, y: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> None:
    if x.stride(1) != 1 or (y is not None and y.stride(1) != 1) or a.stride(2) != 1 or b.stride(2) != 1:
        raise ValueError("lora_triton: x, y, A and B need unit stride in their last dim")


def lora_triton(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, offsets: tuple[int, ...],
                rank: int, sorted_tokens: torch.Tensor, seg_start: torch.Tensor,
                shrunk: torch.Tensor | None = None, block_n: int | None = None,
                config: KernelConfig | None = None) -> torch.Tensor:
    """``lora_reference``'s update with the kernels (in place on ``y``).  ``shrunk``: a float32
    scratch of at least ``split_k(T, K) * T * P*R`` elements (``scratch_elems``; the fused kernel
    needs none); ``rank`` (the slots' padded R) a power of two >= 16; ``config``: the launch
    settings (default: the device's tuned ones for this shape, ``tuning.py``)."""
    check_strides(x, y, a, b)
    launch = plan_launch(x, a, y.shape[1], offsets, rank, block_n, config)
    if launch.config.fused:
        return fused(launch, x, y, a, b, offsets, rank, sorted_tokens, seg_start)
    if shrunk is None:
        shrunk = torch.empty(launch.split * x.shape[0] * a.shape[1], dtype=torch.float32, device=x.device)
    shrink(launch, x, a, shrunk, sorted_tokens, seg_start)
    return expand(launch, shrunk, b, y, offsets, rank, sorted_tokens, seg_start)


def use_triton(x: torch.Tensor, offsets: tuple[int, ...]) -> bool:
    return available() and x.is_cuda and expand_block(offsets[1:]) is not None
