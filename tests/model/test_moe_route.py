"""The fused routing kernel (ray_attn/model/moe_route.py) against ``select_experts``'s torch path
in float64.

On a GPU the compiled kernel runs.  Without one, ``test_kernel_under_the_interpreter`` runs this
module again in a subprocess with TRITON_INTERPRET=1 (read when a kernel is defined), where the
kernel runs in Triton's interpreter on CPU tensors.  Tolerance: 1e-5 relative on the float32
weights (only the order of the float32 sums differs from the float64 reference); the expert ids
must be the reference's, in its order (the logits have no ties).
"""

from __future__ import annotations

import pytest
import torch

from ray_attn.model import moe_route
from ray_attn.model.moe import select_experts
from ray_attn.model.moe_route import fused_select_experts, route_supported
from tests.interpreter import kernels_run_here, run_module_interpreted

if moe_route.triton is None:
    pytest.skip("triton is not installed (the kernel runs on GPUs, or in its interpreter)", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
kernels = pytest.mark.skipif(not kernels_run_here(),
                             reason="CPU: run by test_kernel_under_the_interpreter in a subprocess")


def test_kernel_under_the_interpreter():
    if kernels_run_here():
        pytest.skip("the kernels' tests run in this process")
    run_module_interpreted(__file__, min_passed=32)


@kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scoring,renormalize", [("softmax", False), ("softmax", True), ("sigmoid", False)])
# E: a power of two, one that is not (masked tail), Qwen3-MoE's 128; k: Llama 4's 1, Mixtral's 2,
# a k that is not a power of two (unused vector slots), Qwen3-MoE's 8
@pytest.mark.parametrize("E,k", [(8, 2), (60, 6), (128, 8), (16, 1), (128, 1)])
def test_matches_select_experts(E, k, scoring, renormalize, dtype):
    g = torch.Generator().manual_seed(E * 100 + k)
    T = 5
    if dtype == torch.float32:
        logits = torch.randn(T, E, generator=g) * 3
    else:  # bf16 holds 8 bits of mantissa: random logits tie; a shuffle of steps of 1/16 is exact and distinct
        logits = torch.stack([torch.randperm(E, generator=g) - E // 2 for _ in range(T)]).to(dtype) / 16
    ref_w, ref_ids = select_experts(logits.double(), k, scoring, renormalize)  # torch, float64
    w, ids = fused_select_experts(logits.to(DEVICE), k, scoring, renormalize)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and w.shape == ids.shape == (T, k)
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(w.cpu().double(), ref_w, rtol=1e-5, atol=1e-7)


@kernels
def test_strided_rows_and_empty_batch():
    """Rows of a wider tensor (stride 0 != E), and no tokens at all (a step without this layer's tokens)."""
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(4, 40, generator=g)
    logits = wide[:, :32]
    ref_w, ref_ids = select_experts(logits.double(), 4, "softmax", True)
    w, ids = fused_select_experts(logits.to(DEVICE), 4, "softmax", True)
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(w.cpu().double(), ref_w, rtol=1e-5, atol=1e-7)
    w, ids = fused_select_experts(torch.empty(0, 32, device=DEVICE), 4, "softmax", True)
    assert w.shape == ids.shape == (0, 4)


def test_what_it_refuses():
    """Named errors instead of a kernel fault; select_experts' torch path takes these instead."""
    assert not route_supported(torch.zeros(3, 8, dtype=torch.float64), 2)  # float64 references
    assert not route_supported(torch.zeros(8, 3).t(), 2)  # non-unit stride along the experts
    assert not route_supported(torch.zeros(3, 8), 9)  # more picks than experts
    assert not route_supported(torch.zeros(3, 2048), 2)  # more experts than a program holds
    with pytest.raises(ValueError, match="top_k=9"):
        fused_select_experts(torch.zeros(3, 8), 9, "softmax", False)
    with pytest.raises(ValueError, match="scoring='relu'"):
        fused_select_experts(torch.zeros(3, 8), 2, "relu", False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_select_experts_takes_the_kernel_on_cuda():
    """The dispatch: bf16 router logits on CUDA go through the kernel (float64 never), and give
    the torch path's picks and weights."""
    from ray_attn.model import moe

    g = torch.Generator().manual_seed(7)
    logits = torch.stack([torch.randperm(128, generator=g) - 64 for _ in range(3)]).to("cuda", torch.bfloat16) / 16
    assert moe.use_fused_route(logits, 8) and not moe.use_fused_route(logits.double(), 8)
    w, ids = select_experts(logits, 8, "softmax", True)
    ref_w, ref_ids = select_experts(logits.double(), 8, "softmax", True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w.double(), ref_w, rtol=1e-5, atol=1e-7)
