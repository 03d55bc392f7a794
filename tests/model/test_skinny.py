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


def test_bad_inputs_are_refused_by_name():
    x, w, _ = inputs(5, 32, 64, torch.float16, "cpu", False)
    with pytest.raises(ValueError, match="agree on K"):
        S.skinny(x, w[:, :32])
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        S.skinny(x.float(), w.float())
    with pytest.raises(ValueError, match="bias must be"):
        S.skinny(x, w, torch.zeros(31, dtype=torch.float16))


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
