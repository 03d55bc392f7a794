"""The fused elementwise ops against the formulas they replace: on CPU (the torch path) and, on a
GPU, the Triton kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ray_attn.model import fused
from ray_attn.model.layers import RotaryEmbedding

GPU = pytest.mark.gpu
EPS = 1e-5


# -- reference formulas, written out in float32 with the roundings the model relies on ----------
def ref_rms_norm(x, w, eps=EPS):
    xf = x.float()
    h = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (h.to(x.dtype).float() * w.float()).to(x.dtype)  # HF order: cast, then scale


def ref_rope(qk, cos, sin):
    x1, x2 = qk.float().chunk(2, dim=-1)
    c, s = cos.float(), sin.float()
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(qk.dtype)


def ref_silu_mul(gu):
    g, u = gu.float().chunk(2, dim=-1)
    return (F.silu(g).to(gu.dtype).float() * u).to(gu.dtype)


def rand(rng, *shape, dtype, device="cpu", scale=1.0):
    return (torch.randn(*shape, generator=rng) * scale).to(dtype=dtype, device=device)


def qk_view(rng, T, nq, nk, D, dtype, device="cpu"):
    """qk as the model makes it: a strided view over rows of the fused qkv output."""
    qkv = rand(rng, T, (nq + 2 * nk) * D, dtype=dtype, device=device)
    qk, v = qkv.split([(nq + nk) * D, nk * D], dim=-1)
    return qkv, qk.view(T, nq + nk, D)


def cos_sin(rng, T, D, dtype, device="cpu"):
    rot = RotaryEmbedding(D, 8192, 500000.0, device=device)
    positions = torch.randint(0, 8192, (T,), generator=rng).to(device)
    return rot.cos_sin(positions, dtype)


def ulp_close(actual, expected, ulps, exact_frac=0.99, atol=1e-5):
    """Within ``ulps`` bf16 ulps (2**-7 relative bounds one ulp) and mostly bit-equal."""
    a, e = actual.float(), expected.float()
    assert ((a - e).abs() <= ulps * 2 ** -7 * e.abs() + atol).all(), (a - e).abs().max().item()
    assert (a == e).float().mean().item() >= exact_frac


DTYPES = [torch.float32, torch.bfloat16]


# -- CPU: the torch path is the model's original code, equal to the formulas --------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_cpu(dtype, rng):
    x, w = rand(rng, 5, 96, dtype=dtype, scale=3.0), rand(rng, 96, dtype=dtype) + 1
    if dtype == torch.float32:
        torch.testing.assert_close(fused.rms_norm(x, w, EPS), ref_rms_norm(x, w), rtol=1e-6, atol=1e-6)
    else:
        ulp_close(fused.rms_norm(x, w, EPS), ref_rms_norm(x, w), ulps=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_cpu(dtype, rng):
    x, d = rand(rng, 5, 96, dtype=dtype), rand(rng, 5, 96, dtype=dtype)
    w = rand(rng, 96, dtype=dtype) + 1
    s, y = fused.add_rms_norm(x, d, w, EPS)
    assert torch.equal(s, x + d)
    torch.testing.assert_close(y, fused.rms_norm(x + d, w, EPS), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_cpu(dtype, rng):
    T, nq, nk, D = 6, 4, 2, 64
    qkv, qk = qk_view(rng, T, nq, nk, D, dtype)
    assert qk.stride(0) != (nq + nk) * D  # really strided
    cos, sin = cos_sin(rng, T, D, dtype)
    before = qkv.clone()
    out = RotaryEmbedding.apply(qk, cos, sin)
    assert torch.equal(qkv, before) and out.shape == qk.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref_rope(qk, cos, sin), rtol=1e-6, atol=1e-6)
    else:  # the original code rounds each product and sum to bf16; the formula rounds once
        x1, x2 = qk.chunk(2, dim=-1)
        assert torch.equal(out, torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))
        torch.testing.assert_close(out, ref_rope(qk, cos, sin), rtol=2 ** -6, atol=2 ** -4)
    inplace = fused.apply_rope(qk, cos, sin, inplace=True)
    assert inplace.data_ptr() == qk.data_ptr() and torch.equal(inplace, out)
    assert torch.equal(qkv[:, (nq + nk) * D:], before[:, (nq + nk) * D:])  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_cpu(dtype, rng):
    gu = rand(rng, 5, 2 * 80, dtype=dtype, scale=3.0)
    torch.testing.assert_close(fused.silu_mul(gu), ref_silu_mul(gu), rtol=1e-6, atol=1e-6)


# -- GPU: the Triton kernels ---------------------------------------------------------------------
# float32: only the last fp32 bits differ (approximate rsqrt/exp, FMA contraction, reduction
# order), so 1e-5.  bf16: those fp32 differences can flip a round-to-bf16 when a value sits on a
# rounding boundary.  RoPE rounds once (1 ulp).  RMSNorm and silu*up round an intermediate to bf16
# before the final product, as the torch code does, so a flipped intermediate moves the output by
# up to 1 ulp plus the final rounding's 1 ulp: 2 ulps.  Flips are rare, so >= 99% must be bit-equal.

def gpu_check(out, ref, dtype, ulps):
    assert out.dtype == ref.dtype == dtype and out.shape == ref.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        ulp_close(out, ref, ulps)


@pytest.fixture
def cuda():
    pytest.importorskip("triton")
    assert fused._use_triton(torch.zeros(1, device="cuda"))
    return "cuda"


@GPU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [256, 4096, 5120])
@pytest.mark.parametrize("T", [1, 7, 300])
def test_rms_norm_gpu(T, hidden, dtype, rng, cuda):
    x, d = rand(rng, T, hidden, dtype=dtype, device=cuda), rand(rng, T, hidden, dtype=dtype, device=cuda)
    w = rand(rng, hidden, dtype=dtype, device=cuda, scale=0.2) + 1
    gpu_check(fused.rms_norm(x, w, EPS), ref_rms_norm(x, w), dtype, ulps=2)
    s, y = fused.add_rms_norm(x, d, w, EPS)
    assert torch.equal(s, x + d)  # same rounding of the sum as torch's add
    gpu_check(y, ref_rms_norm(x + d, w), dtype, ulps=2)
    # a strided input (a column slice) normalises its own rows
    wide = rand(rng, T, hidden + 64, dtype=dtype, device=cuda)
    gpu_check(fused.rms_norm(wide[:, 64:], w, EPS), ref_rms_norm(wide[:, 64:], w), dtype, ulps=2)


@GPU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("heads", [(32, 8), (4, 2)])
@pytest.mark.parametrize("T", [1, 7, 300])
def test_rope_gpu(T, heads, D, dtype, rng, cuda):
    nq, nk = heads
    qkv, qk = qk_view(rng, T, nq, nk, D, dtype, device=cuda)
    cos, sin = cos_sin(rng, T, D, dtype, device=cuda)
    ref = ref_rope(qk, cos, sin)
    before = qkv.clone()
    out = RotaryEmbedding.apply(qk, cos, sin)
    assert torch.equal(qkv, before) and out.is_contiguous()
    gpu_check(out, ref, dtype, ulps=1)
    fused.apply_rope(qk, cos, sin, inplace=True)
    assert torch.equal(qk, out)
    assert torch.equal(qkv[:, (nq + nk) * D:], before[:, (nq + nk) * D:])  # v untouched


@GPU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [256, 4096, 5120, 14336])
@pytest.mark.parametrize("T", [1, 7, 300])
def test_silu_mul_gpu(T, n, dtype, rng, cuda):
    gu = rand(rng, T, 2 * n, dtype=dtype, device=cuda, scale=3.0)
    gpu_check(fused.silu_mul(gu), ref_silu_mul(gu), dtype, ulps=2)


@GPU
def test_fused_ops_capture_in_cuda_graph(rng, cuda):
    dtype, T, E, nq, nk, D, n = torch.bfloat16, 8, 512, 4, 2, 128, 384
    x, d = rand(rng, T, E, dtype=dtype, device=cuda), rand(rng, T, E, dtype=dtype, device=cuda)
    w = rand(rng, E, dtype=dtype, device=cuda) + 1
    qkv, qk = qk_view(rng, T, nq, nk, D, dtype, device=cuda)
    cos, sin = cos_sin(rng, T, D, dtype, device=cuda)
    gu = rand(rng, T, 2 * n, dtype=dtype, device=cuda)

    def step():
        s, y = fused.add_rms_norm(x, d, w, EPS)
        return fused.rms_norm(s, w, EPS), y, fused.apply_rope(qk, cos, sin), fused.silu_mul(gu)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = step()
    for src in (x, d, qkv, cos, sin, gu):  # new inputs in the same buffers
        src.copy_(rand(rng, *src.shape, dtype=dtype, device=cuda))
    g.replay()
    torch.cuda.synchronize()
    for a, b in zip(outs, step()):
        assert torch.equal(a, b)
