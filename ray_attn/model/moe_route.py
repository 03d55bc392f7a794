"""A MoE layer's routing (``moe.select_experts``) as one Triton kernel on CUDA.

Why: at one decode token the torch routing of a Qwen3-30B-A3B layer is four or five kernels --
the softmax, ``torch.topk`` (a gather and a bitonic sort, about 9 us together on the H200), the
renormalisation -- each launched for 128 numbers.  Over 48 layers that was 0.55 ms of a 4.4 ms
step (``scripts/profile_decode.py --model qwen3-30b-a3b``, 2026-12-03), more than the attention.
One program per token does it all in registers: the top k picked by k arg-maxes over the
logits (k <= 8 here; an arg-max is a tree reduction, and softmax and sigmoid preserve order, so
picking on the logits picks what ``topk`` over the probabilities would), then the weights of the
picked experts only.

It computes what ``select_experts`` computes, in float32: softmax weights exp(l - max) / sum over
every expert, optionally divided by the picked ones' sum; sigmoid weights of the picked logits.
Ties between equal logits go to the lower expert id (``torch.topk`` leaves their order open).
"""

from __future__ import annotations

import torch

from ray_attn.backend.triton_ops import available
from ray_attn.backend import pdl

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - CPU machines without triton
    triton = None

# Above this many experts a program's registers hold too much; no model we serve comes close
# (Llama 4 Maverick 128, Qwen3-MoE 128, DeepSeek-V3 256).
MAX_EXPERTS = 1024
MAX_TOP_K = 16

if triton is not None:

    @triton.jit
    def _route_kernel(logits_ptr, w_ptr, ids_ptr, E, l_stride, TOPK: tl.constexpr, K_POW: tl.constexpr,
                      SOFTMAX: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr, USE_PDL: tl.constexpr):
        if USE_PDL:  # pdl.py: nothing an earlier kernel writes is read before the wait
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        t = tl.program_id(0).to(tl.int64)
        re = tl.arange(0, BLOCK_E)
        mask = re < E
        logits = tl.load(logits_ptr + t * l_stride + re, mask=mask, other=float("-inf")).to(tl.float32)
        if SOFTMAX:
            top = tl.max(logits, axis=0)
            denom = tl.sum(tl.where(mask, tl.exp(logits - top), 0.0), axis=0)
        rk = tl.arange(0, K_POW)  # vectors are powers of two long: slots from TOPK on stay unused
        kmask = rk < TOPK
        picked_ids = tl.zeros((K_POW,), dtype=tl.int64)
        picked = tl.zeros((K_POW,), dtype=tl.float32)
        left = logits
        for j in tl.static_range(TOPK):
            best = tl.argmax(left, axis=0, tie_break_left=True)
            value = tl.max(left, axis=0)
            picked_ids = tl.where(rk == j, best.to(tl.int64), picked_ids)
            picked = tl.where(rk == j, value, picked)
            left = tl.where(re == best, float("-inf"), left)
        if SOFTMAX:
            weights = tl.where(kmask, tl.exp(picked - top) / denom, 0.0)
            if RENORM:
                weights = weights / tl.sum(weights, axis=0)
        else:
            weights = tl.sigmoid(picked)
        tl.store(w_ptr + t * TOPK + rk, weights, mask=kmask)
        tl.store(ids_ptr + t * TOPK + rk, picked_ids, mask=kmask)


def route_supported(router_logits: torch.Tensor, top_k: int) -> bool:
    return (triton is not None and router_logits.dim() == 2 and router_logits.stride(1) == 1
            and router_logits.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and 0 < top_k <= min(MAX_TOP_K, router_logits.shape[1]) and router_logits.shape[1] <= MAX_EXPERTS)


def use_fused_route(router_logits: torch.Tensor, top_k: int) -> bool:
    """``select_experts`` runs this kernel on CUDA where it can (float64 references never)."""
    return available() and router_logits.is_cuda and route_supported(router_logits, top_k)


def fused_select_experts(router_logits: torch.Tensor, top_k: int, scoring: str,
                         renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``select_experts``'s (float32 weights, int64 ids), each [T, top_k], in one launch.  On a
    machine without a GPU it runs only under ``TRITON_INTERPRET=1``."""
    if triton is None:
        raise RuntimeError("fused_select_experts needs triton")
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring={scoring!r}: choose softmax or sigmoid")
    if not route_supported(router_logits, top_k):
        raise ValueError(f"fused_select_experts: logits {tuple(router_logits.shape)} {router_logits.dtype} "
                         f"(stride {router_logits.stride()}), top_k={top_k}: 2-D, unit stride, a float dtype, "
                         f"top_k in [1, min({MAX_TOP_K}, experts)], at most {MAX_EXPERTS} experts")
    T, E = router_logits.shape
    weights = torch.empty(T, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=router_logits.device)
    if T:
        _route_kernel[(T,)](router_logits, weights, ids, E, router_logits.stride(0), TOPK=top_k,
                            K_POW=triton.next_power_of_2(top_k), SOFTMAX=scoring == "softmax", RENORM=bool(renormalize),
                            BLOCK_E=max(16, triton.next_power_of_2(E)), num_warps=1 if E <= 256 else 4,
                            **pdl.launch(router_logits.device))
    return weights, ids
