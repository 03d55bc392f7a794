"""The bf16/fp16 skinny kernel (ray_attn/model/skinny.py: 2-16 rows on tensor cores) against a
float64 product: on a GPU in bf16 at Llama-3-8B's shapes, and on CPU under Triton's interpreter in
fp16 (its bf16 tl.dot is wrong there; ``test_kernels_under_the_interpreter``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ray_attn.model import gemv as G
from ray_attn.model import kernel_configs
from ray_attn.model import skinny as S
from tests.interpreter import interpreter_test, kernels_mark
from tests.model.test_gemv import inputs, ref  # the same random shapes and float64 product

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
kernels = kernels_mark(S.triton)


def bound(x, w, b, rel):
    """One rounding of the output (``rel``, relative to what it rounds: the product plus the bias)
    and float32 sums of K unit-size terms (~1e-5)."""
    return rel * (ref(x, w, None).abs() + (0 if b is None else b.double().abs())) + 1e-4


def test_kernels_under_the_interpreter():
    interpreter_test(__file__, min_passed=12)


@kernels
@pytest.mark.parametrize("m", [2, 5, 16])
@pytest.mark.parametrize("n,k", [(37, 1000), (130, 264)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_fp16_matches_float64(m, n, k, bias):
    """Ragged N and K (masked tails) and a K of 1000 over 256-wide steps: a tail step dropped or
    a row of x read for another, a lost bias, are off by far more than fp16's one rounding."""
    x, w, b = inputs(m, n, k, torch.float16, DEVICE, bias)
    y = S.skinny(x, w, b, BLOCK_K=256)
    assert y.dtype == torch.float16 and y.shape == (m, n)
    assert ((y.double() - ref(x, w, b)).abs() <= bound(x, w, b, 2 ** -10)).all()


def gate_up_inputs(m, n, k, dtype, device, seed=0):
    """[m, 2k] gate then up (scaled so SiLU leaves its linear part) and a down_proj [n, k]."""
    g = torch.Generator().manual_seed(seed + 11 * m + n + k)
    gu = (torch.randn(m, 2 * k, generator=g) * 2.0).to(dtype=dtype, device=device)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype=dtype, device=device)
    return gu, w


@kernels
@pytest.mark.parametrize("m", [2, 5, 16])
@pytest.mark.parametrize("n,k", [(37, 1000), (130, 264)])
def test_silu_mul_in_the_kernel_equals_the_two_kernels_apart(m, n, k):
    """down(silu(gate) * up) in one skinny kernel (down_proj of a step verifying drafts): the
    product rounded where ``fused.silu_mul`` rounds, then the same tiles and K loop, so equal to
    the bit to the two kernels apart; and gate and up in their places, held to float64 (a swap, or
    up read from the gate's half, is off by far more than the roundings)."""
    from ray_attn.model import fused

    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16  # the interpreter's bf16 dot is wrong
    gu, w = gate_up_inputs(m, n, k, dtype, DEVICE)
    y = S.skinny(gu, w, silu_mul=True, BLOCK_K=256)
    assert torch.equal(y, S.skinny(fused.silu_mul_launch(gu), w, BLOCK_K=256))
    g, u = gu.double().chunk(2, dim=-1)
    want = (g * torch.sigmoid(g) * u) @ w.double().T
    scale = ((g * torch.sigmoid(g) * u).abs() @ w.double().abs().T)
    assert ((y.double() - want).abs() <= 2 ** -7 * scale + 1e-3).all()


def test_stages_fit_the_shared_memory_with_gate_and_up(monkeypatch):
    """Triton buffers num_stages - 1 K steps of x and W: with two x tiles (gate and up) the H100
    table's down_proj entry (5 stages, 227 KB a block) is cut to 4; one x tile keeps 5; off CUDA
    (the interpreter) nothing is cut."""
    monkeypatch.setattr(S, "_smem_limit", lambda dev: 232448 if dev.type == "cuda" else None)
    c = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=512, num_stages=5)
    cuda = torch.device("cuda")
    assert S.fit_stages(c, 2, 2, cuda) == 4 and S.fit_stages(c, 2, 1, cuda) == 5
    assert S.fit_stages(dict(c, BLOCK_K=4096), 2, 2, cuda) == 1
    assert S.fit_stages(c, 2, 2, torch.device("cpu")) == 5


def test_bad_inputs_are_refused_by_name():
    x, w, _ = inputs(5, 32, 64, torch.float16, "cpu", False)
    with pytest.raises(ValueError, match="agree on K"):
        S.skinny(x, w[:, :32])
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        S.skinny(x.float(), w.float())
    with pytest.raises(ValueError, match="bias must be"):
        S.skinny(x, w, torch.zeros(31, dtype=torch.float16))
    with pytest.raises(ValueError, match="gate and up"):
        S.skinny(torch.cat([x, x], 1)[:, :-2], w, silu_mul=True)


def test_cpu_and_untuned_shapes_stay_on_f_linear():
    """Off CPU, outside 2-16 rows, and on a shape the GPU's table does not give it, ``linear`` is
    exactly what it was: the kernel runs only where the tune found it faster than cuBLAS."""
    x, w, _ = inputs(5, 32, 64, torch.bfloat16, "cpu", False)
    assert not S.use_skinny(x, w)
    assert torch.equal(G.linear(x, w), F.linear(x, w))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 5, 16])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (130, 264)])
@pytest.mark.parametrize("bias", [False, True])
def test_gpu_bf16_matches_float64(m, n, k, bias):
    """bf16 in and out, float32 accumulation: one bf16 rounding of the output (2^-8 relative)."""
    x, w, b = inputs(m, n, k, torch.bfloat16, "cuda", bias)
    y = S.skinny(x, w, b)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert ((y.double() - ref(x, w, b)).abs() <= bound(x, w, b, 2 ** -8)).all()


@pytest.mark.gpu
def test_gpu_dispatch_follows_the_table(monkeypatch):
    """A shape the table holds for 2-16 rows runs the kernel through ``linear`` (from a strided x,
    as the model's views are); one row stays the GEMV's and 17 rows cuBLAS's."""
    x, w, b = inputs(16, 4096, 4096, torch.bfloat16, "cuda", True)
    real = kernel_configs.tuned
    monkeypatch.setattr(kernel_configs, "tuned", lambda kern, m, n, k, dev: (
        {"BLOCK_N": 32} if kern == "skinny" and (n, k) == (4096, 4096) and m <= 16 else real(kern, m, n, k, dev)))
    xs = torch.cat([x, x], 1)[:5, :4096]
    assert S.use_skinny(xs, w) and not S.use_skinny(x[:1], w)
    assert torch.equal(G.linear(xs, w, b), S.skinny(xs.contiguous(), w, b))
    assert ((G.linear(xs, w, b).double() - ref(xs, w, b)).abs() <= bound(xs, w, b, 2 ** -8)).all()
    x17 = torch.randn(17, 4096, device="cuda", dtype=torch.bfloat16)
    assert not S.use_skinny(x17, w) and torch.equal(G.linear(x17, w), F.linear(x17, w))


@pytest.mark.gpu
def test_gpu_down_proj_makes_silu_mul_in_the_skinny_kernel(monkeypatch):
    """Opted in (RAY_ATTN_SKINNY_SILU=1; off by default: on an H200 it made the verifying step
    3.1x a plain one), at 2-16 rows on a tuned down_proj shape, the MLP's down_proj takes gate and
    up whole and the skinny kernel makes the product, to the bit what the two apart give; one row
    stays the GEMV's fusion, and an untuned shape runs the two apart (None)."""
    from ray_attn.model import fused

    monkeypatch.setattr(S, "FUSE_SILU", False)
    gu, w = gate_up_inputs(5, 4096, 14336, torch.bfloat16, "cuda")
    assert G.linear_silu_mul(gu, w) is None  # the default: SiLU-mul apart at 2-16 rows
    monkeypatch.setattr(S, "FUSE_SILU", True)
    real = kernel_configs.tuned
    # the H100 table's down_proj entry: five stages of one x tile fit, of two (gate, up) they do
    # not (fit_stages cuts them)
    down = {"BLOCK_N": 32, "BLOCK_K": 512, "num_stages": 5}
    monkeypatch.setattr(kernel_configs, "tuned", lambda kern, m, n, k, dev: (
        down if kern == "skinny" and (n, k) == (4096, 14336) and m <= 16 else real(kern, m, n, k, dev)))
    gu, w = gate_up_inputs(16, 4096, 14336, torch.bfloat16, "cuda")
    for m in (2, 5, 16):
        y = G.linear_silu_mul(gu[:m], w)
        assert y is not None and torch.equal(y, S.skinny(fused.silu_mul_launch(gu[:m]), w))
    assert torch.equal(G.linear_silu_mul(gu[:1], w), G.gemv(gu[:1], w, silu_mul=True))
    gu2, w2 = gate_up_inputs(5, 4096, 1000, torch.bfloat16, "cuda")
    assert G.linear_silu_mul(gu2, w2) is None
