"""The fp8 (e4m3) KV cache against a float64 dense reference, per row, over prefill, mixed and
decode batches, for caches allocated as float8 (ours) and as uint8 (vLLM's), on every kernel
with an fp8 path; plus vLLM's ``calculate_kv_scales``.

The reference attends over K/V *as stored* (rounded to e4m3 at the layer's scales), and over the
query as the kernel sees it (FlashAttention 3 rounds q to e4m3 too), so the tolerance covers only
the kernel's own arithmetic:
- torch kernel, float32: exact up to summation order, 1e-4 relative per row;
- FA3: bf16 output (2^-9 relative) and P rounded to e4m3 before P.V (2^-4 per element, averaging
  out over the row's keys): measured 0.02-0.03 per row on these shapes; we allow 0.05.
Issue 13's defect (a uint8 cache written through the Triton kernel stored integer-converted
values) gave 1.0 on rows whose keys were all written in the step, 0.1-0.2 on short prefill rows
and 0.03-0.10 on decode rows: the prefill and mixed cases catch it, the decode case alone would not.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ray_attn.backend import AttentionLayer, FlashAttentionImpl
from ray_attn.backend.flash_attn import K_SCALE_CONSTANT, Q_SCALE_CONSTANT, V_SCALE_CONSTANT
from tests.backend.batch import add_cascade, dense_reference, expected_cache_after, make_batch
from tests.backend.test_flash_attn import GPU, setup

FP8 = torch.float8_e4m3fn
KERNELS = [pytest.param("torch", id="torch"), pytest.param("fa3", marks=GPU, id="fa3")]
BATCHES = {  # (query lens, kv lens)
    "prefill": ([300, 17, 5], [300, 17, 5]),  # every key written in this step
    "mixed": ([1, 300, 5, 1, 17], [129, 340, 40, 700, 17]),
    "decode": ([1] * 6, [33, 129, 700, 17, 64, 250]),
}
H, HK, D, BS = 16, 4, 128, 16


def rounded(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What an e4m3 store at ``scale`` keeps of ``x``, dequantised, in float64."""
    return (x.float() / scale).to(FP8).double() * scale


def row_errors(out: torch.Tensor, ref: torch.Tensor, q_lens) -> list[float]:
    errs, t = [], 0
    for ql in q_lens:
        o, r = out[t:t + ql].double(), ref[t:t + ql]
        errs.append(float((o - r).norm() / r.norm()))
        t += ql
    return errs


def run_fp8(kernel, batch, layer, *, alloc, meta=None):
    device, dtype, _ = setup(kernel, D, BS, kv_cache_dtype="fp8")
    impl = FlashAttentionImpl(H, D, D ** -0.5, HK, None, None, "fp8", dtype=dtype, block_size=BS,
                              device=device, kernel=kernel)
    cache = batch.kv_cache.to(device)
    if alloc == "uint8":
        cache = cache.view(torch.uint8)  # vLLM's allocation: bytes, viewed as fp8 around kernels
    out = torch.full_like(batch.query, float("nan"), device=device)
    impl.forward(layer, batch.query.to(device), batch.key.to(device), batch.value.to(device), cache,
                 (meta or batch.meta).to_device(device), out)
    return impl, out.cpu(), cache.cpu().view(FP8)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("alloc", ["float8", "uint8"])
@pytest.mark.parametrize("kind", list(BATCHES))
def test_fp8_rows_match_dense(kernel, alloc, kind, rng):
    device, dtype, _ = setup(kernel, D, BS, kv_cache_dtype="fp8")
    k_scale, v_scale, q_scale = 0.04, 0.03, 0.05  # unit normals / scale stay inside e4m3's +-448
    layer = AttentionLayer(k_scale=k_scale, v_scale=v_scale, q_scale=q_scale, device=device)
    q_lens, kv_lens = BATCHES[kind]
    batch = make_batch(q_lens, kv_lens, H=H, Hk=HK, D=D, block_size=BS, dtype=dtype, gen=rng,
                       cache_dtype=FP8, pad_tokens=2)
    before = batch.kv_cache.clone()
    impl, out, cache = run_fp8(kernel, batch, layer, alloc=alloc)
    n = batch.meta.num_actual_tokens
    stored = lambda x, i: (x.float() / (k_scale, v_scale)[i]).to(FP8)
    assert torch.equal(cache.view(torch.uint8), expected_cache_after(batch, before, stored).view(torch.uint8))
    new = (rounded(batch.key[:n], k_scale), rounded(batch.value[:n], v_scale))
    q_seen = rounded(batch.query, q_scale).to(batch.query.dtype) if impl.kernel.quantizes_query else batch.query
    ref = dense_reference(replace(batch, query=q_seen), before,
                          scale=D ** -0.5, k_scale=k_scale, v_scale=v_scale, new_kv_as_stored=new)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    errs = row_errors(out[:n], ref, q_lens)
    assert max(errs) < tol, f"relative error per row {[round(e, 4) for e in errs]} (q_lens={q_lens})"
    assert out[n:].isnan().all(), "padding rows must be left as they were"


@pytest.mark.parametrize("kernel", KERNELS)
def test_fp8_cascade_equals_dense(kernel, rng):
    device, dtype, _ = setup(kernel, D, BS, kv_cache_dtype="fp8")
    k_scale, v_scale = 0.04, 0.03
    layer = AttentionLayer(k_scale=k_scale, v_scale=v_scale, q_scale=0.05, device=device)
    q_lens, kv_lens = [1] * 8, [2 * BS + 1 + 5 * i for i in range(8)]
    groups = [(2, list(range(8)))]
    batch = make_batch(q_lens, kv_lens, H=H, Hk=HK, D=D, block_size=BS, dtype=dtype, gen=rng,
                       groups=groups, cache_dtype=FP8)
    before = batch.kv_cache.clone()
    impl, out, _ = run_fp8(kernel, batch, layer, alloc="float8", meta=add_cascade(batch, groups, BS))
    n = batch.meta.num_actual_tokens
    new = (rounded(batch.key[:n], k_scale), rounded(batch.value[:n], v_scale))
    q_seen = rounded(batch.query, 0.05).to(dtype) if impl.kernel.quantizes_query else batch.query
    ref = dense_reference(replace(batch, query=q_seen), before,
                          scale=D ** -0.5, k_scale=k_scale, v_scale=v_scale, new_kv_as_stored=new)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    assert max(row_errors(out[:n], ref, q_lens)) < tol


class SeedLayer:
    """A layer as vLLM's seed has it: scale tensors only, no ``*_float`` copies."""

    def __init__(self, device, k=0.04, v=0.03, q=0.05):
        self._k_scale = torch.tensor(k, dtype=torch.float32, device=device)
        self._v_scale = torch.tensor(v, dtype=torch.float32, device=device)
        self._q_scale = torch.tensor(q, dtype=torch.float32, device=device)


@pytest.mark.parametrize("kernel", KERNELS)
def test_layer_with_only_scale_tensors(kernel, rng):
    device, dtype, _ = setup(kernel, D, BS, kv_cache_dtype="fp8")
    q_lens, kv_lens = BATCHES["mixed"]
    batch = make_batch(q_lens, kv_lens, H=H, Hk=HK, D=D, block_size=BS, dtype=dtype, gen=rng, cache_dtype=FP8)
    _, seed_out, seed_cache = run_fp8(kernel, batch, SeedLayer(device), alloc="uint8")
    ours = AttentionLayer(k_scale=0.04, v_scale=0.03, q_scale=0.05, device=device)
    _, our_out, our_cache = run_fp8(kernel, batch, ours, alloc="float8")
    assert torch.equal(seed_out, our_out)
    assert torch.equal(seed_cache.view(torch.uint8), our_cache.view(torch.uint8))


@pytest.mark.parametrize("kernel", KERNELS)
def test_calculate_kv_scales_from_the_first_batch(kernel, rng):
    device, dtype, _ = setup(kernel, D, BS, kv_cache_dtype="fp8")
    q_lens, kv_lens = BATCHES["prefill"]
    batch = make_batch(q_lens, kv_lens, H=H, Hk=HK, D=D, block_size=BS, dtype=dtype, gen=rng, cache_dtype=FP8)
    # K and V far past e4m3's 448 (the default scale 1.0 would saturate a third of them), q as
    # much smaller, so that the logits stay of order 1 as in a real model: logits of order 1e4
    # would test FA3's fp8 tensor-core accumulation, not our scales.
    batch.key.mul_(300), batch.value.mul_(300), batch.query.div_(300)
    layer = AttentionLayer(device=device, calculate_kv_scales=True)
    _, out, _ = run_fp8(kernel, batch, layer, alloc="float8")
    n = batch.meta.num_actual_tokens
    want = [batch.key[:n].abs().max().float() / K_SCALE_CONSTANT, batch.value[:n].abs().max().float() / V_SCALE_CONSTANT,
            batch.query[:n].abs().max().float() / Q_SCALE_CONSTANT]
    got = [layer._k_scale.cpu(), layer._v_scale.cpu(), layer._q_scale.cpu()]
    for g, w in zip(got, want):
        torch.testing.assert_close(g.reshape(()), w.reshape(()), rtol=1e-6, atol=0)
    assert (layer._k_scale_float, layer._v_scale_float) == (float(got[0]), float(got[1]))
    assert not layer.calculate_kv_scales, "scales are fixed after the first batch"
    # The output is right at the computed scales (the saturating default would be off by ~30%).
    ks, vs, qs = (float(g) for g in got)
    new = (rounded(batch.key[:n], ks), rounded(batch.value[:n], vs))
    q_seen = rounded(batch.query, qs).to(dtype) if kernel == "fa3" else batch.query
    before = batch.kv_cache
    ref = dense_reference(replace(batch, query=q_seen), before,
                          scale=D ** -0.5, new_kv_as_stored=new)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    assert max(row_errors(out[:n], ref, q_lens)) < tol
    # A second batch does not move them.
    _, _, _ = run_fp8(kernel, batch, layer, alloc="float8")
    assert float(layer._k_scale.cpu()) == ks
