"""The mixture-of-experts MLP every sparse family shares (Mixtral, Qwen3-MoE, Llama 4).

``SparseMoeBlock`` = a replicated router, ``FusedMoE`` (every expert's SwiGLU), and optionally a
shared expert every token also goes through (Llama 4).  What differs between families is
configuration: how routing weights are made (``select_experts``: softmax top-k, optionally
renormalised, or Llama 4's sigmoid of the top-k logits) and where they apply (to the expert's
output, or -- Llama 4, vLLM's ``apply_router_weight_on_input`` -- to its input, which is not the
same function: SwiGLU is not linear).

Tensor parallelism: each rank holds its slice of every expert's inner width (and of the shared
expert's), the router is replicated, so every rank routes identically and the partial sums of the
routed experts and the shared expert meet in one all-reduce per layer, as for the dense MLP.

Two implementations of the experts, the same function:

- ``fused_moe_loop``: a torch loop over the experts a step hits (host syncs: the CPU path and
  the tests' reference);
- ``fused_moe_grouped``: the (token, expert) pairs sorted by expert, one grouped GEMM per
  projection (``torch._grouped_mm``), no host sync and static shapes -- what runs on CUDA and
  inside decode CUDA graphs.

Both combine the k expert outputs of a token the same way (unsorted by a permutation, weighted,
summed over k in float32), so they differ only in the GEMMs.  A third, for a few tokens, lives in
``moe_small.py``: a GEMV per (token, expert) pair in two Triton kernels, with the same roundings.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ray_attn.model.fused import silu_mul
from ray_attn.model.gemv import linear
from ray_attn.model.layers import FusedShard, Shard, new_param, replicated
from ray_attn.model.mlp import MLP
from ray_attn.model.moe_route import fused_select_experts, use_fused_route
from ray_attn.model.moe_small import fused_moe_small, use_small
from ray_attn.model.tp import TPGroup

Scoring = Literal["softmax", "sigmoid"]
MoeImpl = Literal["auto", "loop", "grouped", "small"]
# How a checkpoint stores one layer's experts:
#   w123:     experts.{e}.w1 / w3 / w2.weight (gate, up, down; Mixtral as transformers writes it)
#   proj:     experts.{e}.gate_proj / up_proj / down_proj.weight (Qwen3-MoE as transformers writes it)
#   fused:    experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I] (transformers 5 in memory)
#   fused_t:  experts.gate_up_proj [E, H, 2I], experts.down_proj [E, I, H] (Llama 4 on the hub)
ExpertFormat = Literal["w123", "proj", "fused", "fused_t"]


def select_experts(router_logits: torch.Tensor, top_k: int, scoring: Scoring,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 weights, int64 expert ids), each [T, top_k], as transformers computes them
    (float64 for float64 logits):

    - softmax (Mixtral, Qwen3-MoE): softmax over every expert in float32, its top k, divided by
      their sum when ``renormalize`` (Mixtral always; Qwen3-MoE's ``norm_topk_prob``);
    - sigmoid (Llama 4): the top k of the raw logits, each through a sigmoid (never renormalised).
    """
    if scoring in ("softmax", "sigmoid") and use_fused_route(router_logits, top_k):
        return fused_select_experts(router_logits, top_k, scoring, renormalize)  # one launch (moe_route.py)
    acc = torch.promote_types(router_logits.dtype, torch.float32)  # float32, or a float64 reference's own
    if scoring == "softmax":
        probs = torch.softmax(router_logits.to(acc), dim=-1)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids
    if scoring == "sigmoid":
        values, ids = torch.topk(router_logits, top_k, dim=-1)
        return torch.sigmoid(values.to(acc)), ids
    raise ValueError(f"scoring={scoring!r}: choose softmax or sigmoid")


def _expert_inputs(x, topk_weights, topk_ids, apply_router_weight_on_input):
    """The (token, expert) pairs sorted by expert: their rows of x, the order, the sorted ids."""
    k = topk_ids.shape[1]
    sorted_ids, order = torch.sort(topk_ids.flatten(), stable=True)
    xs = x[order // k]
    if apply_router_weight_on_input:
        # Llama 4 scales the expert's input (HF: hidden * sigmoid score, in the model dtype)
        xs = (xs * topk_weights.flatten()[order, None].to(x.dtype)).to(x.dtype)
    return xs, order, sorted_ids


def _combine(y_sorted, order, topk_weights, apply_router_weight_on_input, out_dtype):
    """Back to (token, k) order by the permutation (deterministic: no atomics), weighted, summed."""
    T, k = topk_weights.shape
    y = torch.empty_like(y_sorted).index_copy_(0, order, y_sorted).view(T, k, -1)
    acc = torch.promote_types(y.dtype, torch.float32)
    if apply_router_weight_on_input:
        return y.to(acc).sum(dim=1).to(out_dtype)
    return (y.to(acc) * topk_weights.to(acc)[..., None]).sum(dim=1).to(out_dtype)


def _swiglu(h: torch.Tensor) -> torch.Tensor:
    if h.dtype == torch.float64:  # the Triton kernel's float32 math would round a float64 reference
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return silu_mul(h)


def fused_moe_loop(x, w13, w2, topk_weights, topk_ids, apply_router_weight_on_input=False):
    """sum_k w_k * expert_{id_k}(x) per token (or expert(w_k * x)), one GEMM pair per expert hit.

    ``w13`` [E, 2n, H] (gate rows, then up rows), ``w2`` [E, H, n].  Reads the per-expert counts on
    the host: the CPU path, and the reference of the grouped path."""
    E = w13.shape[0]
    if x.shape[0] == 0:
        return x.new_zeros(x.shape)
    xs, order, sorted_ids = _expert_inputs(x, topk_weights, topk_ids, apply_router_weight_on_input)
    counts = torch.bincount(sorted_ids, minlength=E).tolist()
    y = xs.new_empty(xs.shape[0], w2.shape[1])
    start = 0
    for e, c in enumerate(counts):
        if c:
            rows = slice(start, start + c)
            y[rows] = linear(_swiglu(linear(xs[rows], w13[e])), w2[e])
            start += c
    return _combine(y, order, topk_weights, apply_router_weight_on_input, x.dtype)


def fused_moe_grouped(x, w13, w2, topk_weights, topk_ids, apply_router_weight_on_input=False):
    """``fused_moe_loop``'s function with one grouped GEMM per projection: no host sync, every
    shape fixed by (tokens, top_k), so a CUDA graph can hold it.  Group e's rows end at
    ``offs[e]`` = the number of pairs routed to experts <= e (a searchsorted on the sorted ids)."""
    E = w13.shape[0]
    if x.shape[0] == 0:
        return x.new_zeros(x.shape)
    xs, order, sorted_ids = _expert_inputs(x, topk_weights, topk_ids, apply_router_weight_on_input)
    bounds = torch.arange(1, E + 1, device=x.device, dtype=sorted_ids.dtype)
    offs = torch.searchsorted(sorted_ids, bounds, out_int32=True)
    h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
    y = torch._grouped_mm(_swiglu(h).contiguous(), w2.transpose(1, 2), offs=offs)
    return _combine(y, order, topk_weights, apply_router_weight_on_input, x.dtype)


def grouped_mm_supported(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Where ``fused_moe_grouped`` runs: torch's grouped GEMM on CUDA takes bf16 (Hopper's
    CUTLASS kernel) with every row 16-byte aligned; elsewhere the loop runs."""
    if not (x.is_cuda and hasattr(torch, "_grouped_mm") and x.dtype == torch.bfloat16):
        return False
    return all(d * x.element_size() % 16 == 0 for d in (x.shape[-1], w13.shape[1] // 2, w2.shape[1]))


class FusedMoE(nn.Module):
    """Every expert's SwiGLU; this rank keeps its slice of each expert's inner width: ``w13``
    [E, 2n, H] (gate rows then up rows, as vLLM's FusedMoE), ``w2`` [E, H, n].  ``forward`` returns
    this rank's partial sum; the caller all-reduces it.  ``impl``: "auto" picks the small-batch
    kernels for up to ``moe_small.SMALL_MAX_TOKENS`` tokens on CUDA, else the grouped GEMM on CUDA
    (``grouped_mm_supported``), and the loop elsewhere; "loop" / "grouped" / "small" force one.  The
    loop reads per-expert counts on the host, so a CUDA model in float16/float32 (or a torch
    without ``_grouped_mm``) cannot capture decode graphs: ``cuda_graphs="auto"`` then runs eagerly."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TPGroup, *,
                 impl: MoeImpl = "auto", dtype, device):
        super().__init__()
        if intermediate % tp.size:
            raise ValueError(f"tp_size={tp.size} must divide the experts' intermediate size {intermediate}")
        n = intermediate // tp.size
        self.num_experts, self.hidden, self.intermediate, self.n = num_experts, hidden, intermediate, n
        self.start = tp.rank * n
        self.impl = impl
        self.w13 = new_param(num_experts, 2 * n, hidden, dtype=dtype, device=device)
        self.w2 = new_param(num_experts, hidden, n, dtype=dtype, device=device)

    def forward(self, x, topk_weights, topk_ids, apply_router_weight_on_input=False):
        impl = self.impl
        if impl == "auto":
            impl = ("small" if use_small(x, self.w13, self.w2) else
                    "grouped" if grouped_mm_supported(x, self.w13, self.w2) else "loop")
        fn = {"small": fused_moe_small, "grouped": fused_moe_grouped}.get(impl, fused_moe_loop)
        return fn(x, self.w13, self.w2, topk_weights, topk_ids, apply_router_weight_on_input)

    # -- checkpoint names -------------------------------------------------------------------
    def hf_shards(self, prefix: str, fmt: ExpertFormat) -> dict:
        """This rank's pieces under ``prefix`` (".../experts.") in checkpoint format ``fmt``."""
        E, H, I, n, r0 = self.num_experts, self.hidden, self.intermediate, self.n, self.start
        gate, up = self.w13[:, :n], self.w13[:, n:]
        if fmt in ("w123", "proj"):
            names = ("w1", "w3", "w2") if fmt == "w123" else ("gate_proj", "up_proj", "down_proj")
            s = {}
            for e in range(E):
                p = f"{prefix}{e}."
                s[p + names[0] + ".weight"] = Shard(gate[e], (I, H), 0, r0)
                s[p + names[1] + ".weight"] = Shard(up[e], (I, H), 0, r0)
                s[p + names[2] + ".weight"] = Shard(self.w2[e], (H, I), 1, r0)
            return s
        if fmt == "fused":
            full = (E, 2 * I, H)
            return {prefix + "gate_up_proj": FusedShard([Shard(gate, full, 1, r0), Shard(up, full, 1, I + r0)], full),
                    prefix + "down_proj": Shard(self.w2, (E, H, I), 2, r0)}
        if fmt == "fused_t":
            full = (E, H, 2 * I)
            return {prefix + "gate_up_proj": FusedShard([Shard(gate.transpose(1, 2), full, 2, r0, "matrix_t"),
                                                         Shard(up.transpose(1, 2), full, 2, I + r0, "matrix_t")],
                                                        full, "matrix_t"),
                    prefix + "down_proj": Shard(self.w2.transpose(1, 2), (E, I, H), 1, r0, "matrix_t")}
        raise ValueError(f"unknown expert format {fmt!r}")


class SparseMoeBlock(nn.Module):
    """Router + experts (+ shared expert), one all-reduce.  ``scoring``/``renormalize`` pick the
    routing (``select_experts``); ``apply_router_weight_on_input``: Llama 4's scaling of each
    expert's input instead of its output."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, tp: TPGroup, *,
                 scoring: Scoring = "softmax", renormalize: bool = False,
                 apply_router_weight_on_input: bool = False, shared_intermediate: int | None = None,
                 impl: MoeImpl = "auto", dtype, device):
        super().__init__()
        if top_k > num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must not exceed num_local_experts={num_experts}")
        self.tp, self.top_k, self.scoring, self.renormalize = tp, top_k, scoring, renormalize
        self.apply_router_weight_on_input = apply_router_weight_on_input
        self.gate = new_param(num_experts, hidden, dtype=dtype, device=device)  # the router, replicated
        self.experts = FusedMoE(num_experts, hidden, intermediate, tp, impl=impl, dtype=dtype, device=device)
        self.shared_expert = None if shared_intermediate is None else MLP(
            hidden, shared_intermediate, tp, activation="silu", dtype=dtype, device=device)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return select_experts(linear(x, self.gate), self.top_k, self.scoring, self.renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = self.experts(x, weights, ids, self.apply_router_weight_on_input)
        if self.shared_expert is not None:
            s = self.shared_expert
            # its partial sum joins the experts' before the one all-reduce (no reduce in its down)
            out = linear(_swiglu(s.gate_up(x)), s.down.weight) + out
        return self.tp.all_reduce(out)

    def hf_shards(self, prefix: str, *, router: str, fmt: ExpertFormat, shared: str = "shared_expert") -> dict:
        s = {f"{prefix}{router}.weight": replicated(self.gate), **self.experts.hf_shards(prefix + "experts.", fmt)}
        if self.shared_expert is not None:
            s.update(self.shared_expert.hf_shards(f"{prefix}{shared}."))
        return s
