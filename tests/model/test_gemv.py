"""The Triton GEMV (ray_attn/model/gemv.py) against a float64 product: on a GPU in bf16, and on
CPU under Triton's interpreter (``test_kernels_under_the_interpreter`` runs this module's kernel
tests again in a subprocess with TRITON_INTERPRET=1), split-K (``splitk.py``) included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ray_attn.model import gemv as G
from tests.interpreter import interpreter_test, kernels_mark

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
kernels = kernels_mark(G.triton)

# Shapes with ragged N and K (masked tails) beside the Llama-3-8B ones the kernel is tuned for.
SHAPES = [(37, 1000), (6144, 4096), (4096, 14336), (130, 264)]


def ref(x, w, b):
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def inputs(m, n, k, dtype, device, bias, seed=0):
    g = torch.Generator().manual_seed(seed + 7 * m + n + k)
    x = torch.randn(m, k, generator=g).to(dtype=dtype, device=device)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype=dtype, device=device)
    b = torch.randn(n, generator=g).to(dtype=dtype, device=device) if bias else None
    return x, w, b


@pytest.mark.parametrize("m", [1, 2, 3, 4, 9])
def test_cpu_float32_is_onednn_or_mkl_within_float64_and_other_dtypes_exactly_f_linear(m):
    """float32 on CPU runs oneDNN's matmul from ``CPU_MKL_MAX_ROWS + 1`` rows (``gemv.use_onednn``),
    MKL's F.linear below: another summation order than each other, so both are held to float64
    (70 unit terms: errors ~1e-6; 1e-5 catches a dropped bias or a transposed weight); bfloat16
    stays exactly F.linear."""
    x, w, b = inputs(m, 33, 70, torch.float32, "cpu", True)
    assert not G.use_gemv(x, w)
    assert G.use_onednn(x, w) == (G.CPU_ONEDNN and m > G.CPU_MKL_MAX_ROWS)
    want = F.linear(x.double(), w.double(), b.double())
    assert (G.linear(x, w, b).double() - want).abs().max().item() < 1e-5
    assert (G.linear(x, w).double() - F.linear(x.double(), w.double())).abs().max().item() < 1e-5
    xb, wb, bb = (t.bfloat16() for t in (x, w, b))
    assert not G.use_onednn(xb, wb) and torch.equal(G.linear(xb, wb, bb), F.linear(xb, wb, bb))
    assert not G.use_onednn(x, w.t().contiguous().t())  # a strided weight: F.linear


@pytest.mark.skipif(not G.CPU_ONEDNN or not G.PACK, reason="oneDNN's matmul (and packing) only")
def test_cpu_packed_weight_follows_the_weight_when_it_changes_in_place():
    """The oneDNN path reads a packed copy of the weight, made once: a weight loaded in place
    after it (a reload, a test that copies new values in) must not be answered from the stale copy."""
    m = G.CPU_MKL_MAX_ROWS + 2
    x, w, b = inputs(m, 33, 70, torch.float32, "cpu", True)
    assert G.use_onednn(x, w)
    first = G.linear(x, w, b)
    assert G.onednn_weight(w) is G.onednn_weight(w)  # packed once
    with torch.no_grad():
        w.copy_(torch.randn(w.shape, generator=torch.Generator().manual_seed(1)))
    want = F.linear(x.double(), w.double(), b.double())
    assert (G.linear(x, w, b).double() - want).abs().max().item() < 1e-5
    assert (first.double() - want).abs().max().item() > 1e-2  # the new weight does change it


def test_cpu_linear_rule_is_the_vendors_and_the_env_forces_it():
    """Intel keeps up to 3 rows on MKL, others run oneDNN at every size, RAY_ATTN_CPU_ONEDNN=1 is
    oneDNN everywhere (=0 turns CPU_ONEDNN off instead); the rule, not a timing, so every process
    on a machine picks alike."""
    assert G.mkl_max_rows("auto", "GenuineIntel") == 3
    assert G.mkl_max_rows("auto", "AuthenticAMD") == 0
    assert G.mkl_max_rows("1", "GenuineIntel") == 0
    assert G.mkl_max_rows("auto", "") == 0


def test_kernels_under_the_interpreter():
    interpreter_test(__file__, min_passed=12)


@kernels
@pytest.mark.parametrize("m", [1, 3, 4])
@pytest.mark.parametrize("n,k", [(37, 1000), (130, 264)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_float32_matches_float64(m, n, k, bias):
    """float32 in, float32 out: only the summation order differs from float64 (K <= 1000 terms of
    unit size: errors ~1e-6), so 1e-4 catches a dropped tail block, a wrong row or a lost bias."""
    x, w, b = inputs(m, n, k, torch.float32, DEVICE, bias)
    y = G.gemv(x, w, b, BLOCK_K=256)
    torch.testing.assert_close(y.double(), ref(x, w, b), rtol=0, atol=1e-4)


@kernels
@pytest.mark.parametrize("n,k", [(37, 1000), (130, 264)])
def test_weight_only_fp8_matches_float64(n, k):
    """e4m3 weights with float32 row scales against x itself (``w8a16``): the codes are exact in
    float32, so only the summation order differs from float64 -- 1e-4, as above; a scale left
    out (or applied per column) is off by orders more."""
    from ray_attn.model import fp8 as F8

    x, w, b = inputs(1, n, k, torch.float32, DEVICE, True)
    wq, ws = F8.quantize_per_row(w)
    want = F.linear(x.double(), wq.double() * ws.double()[:, None], b.double())
    torch.testing.assert_close(G.gemv(x, wq, b, w_scale=ws, BLOCK_K=256).double(), want, rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="weight-only FP8"):
        G.gemv(x, wq, w_scale=ws[:-1])


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_gpu_bf16_matches_float64(m, n, k, bias):
    """bf16 in and out, float32 accumulation.  Each rounding is relative to what it rounds: the
    product x W^T (once, or twice where F.linear rounds it before adding the bias) and the sum with
    the bias, each to bf16 (2^-9 relative); float32 sums of K <= 14336 unit-size terms add ~1e-5.
    Bound: 2^-8 x (|x W^T| + |b|) + 1e-4."""
    pytest.importorskip("triton")
    x, w, b = inputs(m, n, k, torch.bfloat16, "cuda", bias)
    assert G.use_gemv(x, w) == (G.ENABLED and m <= G.MAX_ROWS and n <= G.MAX_N)
    r = ref(x, w, b)
    tol = 2 ** -8 * (ref(x, w, None).abs() + (0 if b is None else b.double().abs())) + 1e-4
    y = G.gemv(x, w, b)  # any row count works; the dispatch picks where it is used
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert ((y.double() - r).abs() <= tol).all()
    # through the dispatch, from a strided x (a column slice, as the model's views are): our
    # kernels where they serve, else exactly F.linear (cuBLAS, whose bf16 split-K reductions are
    # not held to this bound)
    xs = torch.cat([x, x], 1)[:, :k]
    if G.use_gemv(xs, w) or G.skinny.use_skinny(xs, w):  # the skinny kernel: 2-16 rows, where this GPU's table has it
        assert ((G.linear(xs, w, b).double() - r).abs() <= tol).all()
    else:
        assert torch.equal(G.linear(xs, w, b), F.linear(xs, w, b))

