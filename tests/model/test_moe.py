"""The shared MoE layer (ray_attn/model/moe.py) against a float64 reference written the way
transformers computes each family: every expert applied densely to every token, weighted by a
dense [tokens, experts] routing matrix (zero off the top k).

Fresh random inputs per test; router logits of order 1, so the top-k differs from token to token.
Tolerances: 1e-10 for float64 paths (only summation order differs), 1e-4 for the float32 grouped
GEMM (torch's CPU fallback of ``torch._grouped_mm``) on activations of order 1.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ray_attn.model.moe import (SparseMoeBlock, fused_moe_grouped, fused_moe_loop, grouped_mm_supported,
                                select_experts)
from ray_attn.model.tp import TPGroup

F64 = 1e-10
F32 = 1e-4


def ref_routing(logits, k, scoring, renormalize):
    """Dense [T, E] routing weights, zero off each token's top k (float64)."""
    logits = logits.double()
    if scoring == "sigmoid":  # Llama4Router: top-k of the logits, sigmoid of those, -inf elsewhere
        top, idx = logits.topk(k, dim=-1)
        return torch.full_like(logits, float("-inf")).scatter(1, idx, top).sigmoid()
    probs = logits.softmax(-1)
    top, idx = probs.topk(k, dim=-1)
    if renormalize:
        top = top / top.sum(-1, keepdim=True)
    return torch.zeros_like(probs).scatter(1, idx, top)


def ref_experts(x, w13, w2, dense, on_input):
    """sum_e dense[:, e] * expert_e(x), or expert_e(dense[:, e] * x) (Llama4TextMoe), in float64."""
    x, w13, w2, dense = x.double(), w13.double(), w2.double(), dense.double()
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        s = dense[:, e:e + 1]
        xe = x * s if on_input else x
        gate, up = (xe @ w13[e].T).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w2[e].T
        out += y if on_input else s * y
    return out


def weights(E, H, n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * n, H, generator=g, dtype=torch.float64) * H ** -0.5
    w2 = torch.randn(E, H, n, generator=g, dtype=torch.float64) * n ** -0.5
    return w13.to(dtype), w2.to(dtype)


@pytest.mark.parametrize("scoring,renormalize", [("softmax", True), ("softmax", False), ("sigmoid", False)])
def test_select_experts_matches_reference(scoring, renormalize):
    logits = torch.randn(200, 16, dtype=torch.float64)
    w, ids = select_experts(logits, 4, scoring, renormalize)
    dense = torch.zeros(200, 16, dtype=torch.float64).scatter(1, ids, w.double())
    torch.testing.assert_close(dense, ref_routing(logits, 4, scoring, renormalize), atol=1e-6, rtol=0)
    assert len({tuple(sorted(r)) for r in ids.tolist()}) > 50  # routing depends on the token


def test_renormalisation_changes_the_weights():
    """norm_topk_prob is not a no-op: a routing that ignored it would fail the test above."""
    logits = torch.randn(50, 8)
    a, _ = select_experts(logits, 2, "softmax", True)
    b, _ = select_experts(logits, 2, "softmax", False)
    torch.testing.assert_close(a.sum(-1), torch.ones(50))
    assert (a - b).abs().min() > 1e-3


@pytest.mark.parametrize("on_input", [False, True])
@pytest.mark.parametrize("T,E,k", [(37, 8, 2), (1, 16, 4), (5, 64, 8), (64, 4, 1)])
def test_loop_matches_dense_reference_in_float64(T, E, k, on_input):
    H, n = 32, 24
    w13, w2 = weights(E, H, n, torch.float64, seed=T * E)
    x = torch.randn(T, H, dtype=torch.float64)
    logits = torch.randn(T, E, dtype=torch.float64)
    scoring = "sigmoid" if on_input else "softmax"
    w, ids = select_experts(logits, k, scoring, renormalize=not on_input)
    got = fused_moe_loop(x, w13, w2, w, ids, on_input)
    want = ref_experts(x, w13, w2, ref_routing(logits, k, scoring, not on_input), on_input)
    assert (got - want).abs().max() < F64
    assert want.abs().max() > 1e3 * F64  # not ~0 (a std floor flaked at T=1)


@pytest.mark.parametrize("on_input", [False, True])
@pytest.mark.parametrize("T,E,k", [(37, 8, 2), (1, 16, 4), (200, 32, 8), (3, 64, 2)])
def test_grouped_matches_loop_and_reference_in_float32(T, E, k, on_input):
    """The grouped-GEMM path on CPU (torch's fallback): same sort, offsets and combine as on CUDA,
    experts with no token included (E > T * k for some cases)."""
    H, n = 64, 32  # rows 16-byte aligned, as grouped_mm needs
    w13, w2 = weights(E, H, n, torch.float32, seed=T + E)
    x = torch.randn(T, H)
    logits = torch.randn(T, E)
    scoring = "sigmoid" if on_input else "softmax"
    renorm = not on_input  # renormalised: outputs of order 1 whatever E (not ~k/E)
    w, ids = select_experts(logits, k, scoring, renormalize=renorm)
    grouped = fused_moe_grouped(x, w13, w2, w, ids, on_input)
    loop = fused_moe_loop(x, w13, w2, w, ids, on_input)
    want = ref_experts(x, w13, w2, ref_routing(logits, k, scoring, renorm), on_input)
    assert (grouped.double() - want).abs().max() < F32
    assert (loop.double() - want).abs().max() < F32
    assert want.abs().max() > 1e3 * F32  # the check means something, far above the tolerance


def test_empty_step():
    w13, w2 = weights(4, 32, 16, torch.float32, 0)
    x = torch.zeros(0, 32)
    ids, w = torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2)
    assert fused_moe_loop(x, w13, w2, w, ids).shape == (0, 32)
    assert fused_moe_grouped(x, w13, w2, w, ids).shape == (0, 32)


def test_grouped_is_chosen_only_on_cuda_bf16():
    w13, w2 = weights(4, 64, 32, torch.bfloat16, 0)
    assert not grouped_mm_supported(torch.zeros(2, 64, dtype=torch.bfloat16), w13, w2)  # CPU: the loop


def block(shared: int | None, scoring, renormalize, on_input, tp=TPGroup(), dtype=torch.float64, impl="auto"):
    b = SparseMoeBlock(32, 8, 2, 48, tp, scoring=scoring, renormalize=renormalize,
                       apply_router_weight_on_input=on_input, shared_intermediate=shared, impl=impl,
                       dtype=dtype, device="cpu")
    g = torch.Generator().manual_seed(11)
    for p in b.parameters():
        p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * p.shape[-1] ** -0.5)
    return b


@pytest.mark.parametrize("shared,scoring,renormalize,on_input", [
    (48, "sigmoid", False, True),     # Llama 4
    (None, "softmax", True, False),   # Mixtral, Qwen3-MoE with norm_topk_prob
    (None, "softmax", False, False),  # Qwen3-MoE
])
def test_sparse_block_matches_reference(shared, scoring, renormalize, on_input):
    b = block(shared, scoring, renormalize, on_input)
    x = torch.randn(40, 32, dtype=torch.float64)
    want = ref_experts(x, b.experts.w13, b.experts.w2, ref_routing(x @ b.gate.T, 2, scoring, renormalize), on_input)
    if shared:
        s = b.shared_expert
        gate, up = (x @ s.gate_up.weight.T).chunk(2, dim=-1)
        want = want + (F.silu(gate) * up) @ s.down.weight.T
    got = b(x)
    assert (got - want).abs().max() < F64
    # Each routing choice matters: the other variants of the block compute something else.
    for other in [(scoring, not renormalize, on_input), (scoring, renormalize, not on_input)]:
        if other[0] == "sigmoid" and other[1]:
            continue
        b2 = block(shared, *other)
        assert (b2(x) - got).abs().max() > 1e-3


class _SumGroup(TPGroup):
    """TP ranks simulated in one process: all_reduce records each rank's partial sum."""

    def __init__(self, rank, size, sink):
        super().__init__(rank, size, group=object())
        self.sink = sink

    def all_reduce(self, x):
        self.sink.append(x.clone())
        return x


@pytest.mark.parametrize("tp", [2, 4])
def test_expert_width_split_sums_to_the_whole(tp):
    """Each rank's slice of every expert (and of the shared expert) gives a partial sum; the
    partial sums of the ranks add up to the unsplit block's output: one all-reduce per layer."""
    full = block(48, "sigmoid", False, True)
    x = torch.randn(30, 32, dtype=torch.float64)
    want = full(x)
    parts = []
    for r in range(tp):
        b = block(48, "sigmoid", False, True, tp=_SumGroup(r, tp, parts))
        n = 48 // tp
        b.gate.copy_(full.gate)
        for w_loc, w in ((b.experts.w13, full.experts.w13),):
            w_loc.copy_(torch.cat([w[:, r * n:(r + 1) * n], w[:, 48 + r * n:48 + (r + 1) * n]], dim=1))
        b.experts.w2.copy_(full.experts.w2[:, :, r * n:(r + 1) * n])
        b.shared_expert.gate_up.weight.copy_(torch.cat([full.shared_expert.gate_up.weight[r * n:(r + 1) * n],
                                                        full.shared_expert.gate_up.weight[48 + r * n:48 + (r + 1) * n]]))
        b.shared_expert.down.weight.copy_(full.shared_expert.down.weight[:, r * n:(r + 1) * n])
        b(x)
    assert len(parts) == tp  # one reduction per rank per layer
    assert (sum(parts) - want).abs().max() < F64


# -- on a GPU: the grouped GEMM path (what runs there) against the loop ---------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("on_input", [False, True])
@pytest.mark.parametrize("T,E,k,H,n", [(1, 128, 8, 2048, 768), (64, 128, 8, 2048, 768), (256, 16, 1, 5120, 8192),
                                       (7, 8, 2, 1024, 256)])
def test_grouped_matches_loop_on_cuda_bf16(T, E, k, H, n, on_input):
    """bf16 tolerance: both paths round the same products to bf16 at the same points (the GEMM
    outputs and the SwiGLU), with different accumulation orders inside the GEMMs: 2% of the
    output's scale; a wrong group offset or permutation moves whole rows by ~100%."""
    torch.manual_seed(T + E)
    w13, w2 = weights(E, H, n, torch.bfloat16, seed=E)
    w13, w2 = w13.cuda(), w2.cuda()
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    w, ids = select_experts(torch.randn(T, E, device="cuda"), k, "sigmoid" if on_input else "softmax", True)
    assert grouped_mm_supported(x, w13, w2)
    grouped = fused_moe_grouped(x, w13, w2, w, ids, on_input).float()
    loop = fused_moe_loop(x, w13, w2, w, ids, on_input).float()
    dense = torch.zeros(T, E, dtype=torch.float64, device="cuda").scatter(1, ids, w.double())
    want = ref_experts(x, w13, w2, dense, on_input).float()  # float64 on the GPU (the CPU would take minutes)
    scale = want.abs().max().item()
    assert (grouped - loop).abs().max().item() < 0.02 * scale
    assert (grouped - want).abs().max().item() < 0.02 * scale


@pytest.mark.gpu
def test_grouped_moe_replays_in_a_cuda_graph():
    """No host sync and static shapes: a captured block replays with new inputs (new routing)
    and matches the eager loop on them."""
    b = SparseMoeBlock(1024, 16, 2, 512, TPGroup(), scoring="softmax", renormalize=True,
                       shared_intermediate=256, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    for p in b.parameters():
        p.copy_(torch.randn(p.shape, generator=g, device="cuda") * p.shape[-1] ** -0.5)
    x = torch.randn(32, 1024, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        b(x)  # warm-up outside the capture (Triton compiles, cuBLAS/CUTLASS workspaces)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = b(x)
    for seed in range(3):
        x.copy_(torch.randn(32, 1024, device="cuda", dtype=torch.bfloat16, generator=g))
        graph.replay()
        b.experts.impl = "loop"
        want = b(x).float()
        b.experts.impl = "auto"
        assert (y.float() - want).abs().max().item() < 0.02 * want.abs().max().item(), seed
