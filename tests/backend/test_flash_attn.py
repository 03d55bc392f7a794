"""FlashAttentionImpl against a float64 dense reference, over the feature grid, on every kernel
this machine has (the torch kernel on CPU; flash-attn 2 and 3 on the GPU machine).

Tolerances: float32 inputs on the torch kernel agree with float64 to ~1e-6; we allow 1e-4 for
accumulation over a few hundred keys.  bfloat16 stores 8 mantissa bits, so outputs (convex mixes
of unit-normal values) carry ~4e-3 rounding per element; we allow 2e-2.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ray_attn.backend import AttentionLayer, FlashAttentionImpl, unsupported_reason
from ray_attn.backend.kernels import LayerKernelSpec
from tests.backend.batch import add_cascade, dense_reference, expected_cache_after, make_batch

GPU = pytest.mark.gpu
KERNELS = [pytest.param("torch", id="torch"),
           pytest.param("fa2", marks=GPU, id="fa2"),
           pytest.param("fa3", marks=GPU, id="fa3")]

MIXED_Q = [1, 7, 1, 33, 1]  # decode, chunked prefill, decode, prefill, decode
MIXED_KV = [40, 7, 300, 90, 17]


def setup(kernel, head_size, block_size, alibi=False, kv_cache_dtype="auto"):
    """(device, dtype, atol) for a kernel, skipping configurations the kernel cannot run."""
    if kernel == "torch":
        device, dtype, atol = torch.device("cpu"), torch.float32, 1e-4
    else:
        device, dtype, atol = torch.device("cuda"), torch.bfloat16, 2e-2
    reason = unsupported_reason(kernel, LayerKernelSpec(head_size, dtype, kv_cache_dtype, block_size, alibi), device)
    if reason:
        pytest.skip(reason)
    return device, dtype, atol


def alibi_slopes(n):
    return [2 ** (-8 * (i + 1) / n) for i in range(n)]


def run(impl, batch, device, meta=None, layer=None):
    meta = (meta or batch.meta).to_device(device)
    out = torch.full_like(batch.query, float("nan"), device=device)
    cache = batch.kv_cache.to(device)
    impl.forward(layer or AttentionLayer(device=device), batch.query.to(device), batch.key.to(device),
                 batch.value.to(device), cache, meta, out)
    return out.cpu(), cache.cpu()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("feature", ["plain", "window", "alibi", "softcap"])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_paged_attention_matches_dense(kernel, head_size, gqa, block_size, feature, rng):
    device, dtype, atol = setup(kernel, head_size, block_size, alibi=feature == "alibi")
    Hk = 2
    H = Hk * gqa
    scale = head_size ** -0.5
    window = 24 if feature == "window" else None
    slopes = alibi_slopes(H) if feature == "alibi" else None
    softcap = 5.0 if feature == "softcap" else None
    impl = FlashAttentionImpl(H, head_size, scale, Hk, slopes, window, "auto", logits_soft_cap=softcap,
                              dtype=dtype, block_size=block_size, device=device, kernel=kernel)
    batch = make_batch(MIXED_Q, MIXED_KV, H=H, Hk=Hk, D=head_size, block_size=block_size,
                       dtype=dtype, gen=rng, pad_tokens=3)
    before = batch.kv_cache.clone()
    out, cache = run(impl, batch, device)
    ref = dense_reference(batch, before, scale=scale, window=window, alibi=slopes,
                          softcap=softcap or 0.0)
    n = batch.meta.num_actual_tokens
    torch.testing.assert_close(out[:n].double(), ref, atol=atol, rtol=atol)
    assert out[n:].isnan().all(), "padding rows must be left as they were"
    # The cache write touched exactly this step's slots, and nothing else.
    exp = expected_cache_after(batch, before, lambda x, _: x.to(before.dtype))
    assert torch.equal(cache, exp)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("feature", ["plain", "softcap", "window"])
@pytest.mark.parametrize("shape", ["one_group", "multi_group", "with_prefill"])
def test_cascade_equals_plain(kernel, shape, feature, rng):
    head_size, Hk, H = 128, 2, 8
    block_size = 16 if kernel != "fa2" else 256
    device, dtype, atol = setup(kernel, head_size, block_size)
    P = 2  # shared blocks per group
    pre = P * block_size
    if shape == "one_group":
        q_lens = [1] * 8
        kv_lens = [pre + 1 + 13 * i for i in range(8)]
        groups = [(P, list(range(8)))]
    elif shape == "multi_group":
        q_lens = [1] * 9
        kv_lens = [pre + 3 + 7 * i for i in range(9)]
        groups = [(P, [0, 1, 2]), (P + 1, [3, 4]), (1, [5, 6, 7, 8])]
        kv_lens[3:5] = [pre + block_size + 5, pre + block_size + 9]
    else:  # queries of several tokens after the shared prefix, in several groups
        q_lens = [5, 1, 12, 1, 3]
        kv_lens = [pre + 5, pre + 30, pre + 20, pre + 2, pre + 40]
        groups = [(P, [0, 1, 2]), (P, [3, 4])]
    # A window wide enough to cover every query's whole context: the case the planner allows.
    window = max(kv_lens) + 1 if feature == "window" else None
    softcap = 8.0 if feature == "softcap" else None
    impl = FlashAttentionImpl(H, head_size, head_size ** -0.5, Hk, None, window, "auto",
                              logits_soft_cap=softcap, dtype=dtype, block_size=block_size,
                              device=device, kernel=kernel)
    batch = make_batch(q_lens, kv_lens, H=H, Hk=Hk, D=head_size, block_size=block_size,
                       dtype=dtype, gen=rng, groups=groups)
    before = batch.kv_cache.clone()
    plain, _ = run(impl, batch, device)
    cascade, cache = run(impl, batch, device, meta=add_cascade(batch, groups, block_size))
    ref = dense_reference(batch, before, scale=head_size ** -0.5, window=window,
                          softcap=softcap or 0.0)
    torch.testing.assert_close(cascade.double(), ref, atol=atol, rtol=atol)
    torch.testing.assert_close(cascade, plain, atol=atol, rtol=atol)
    assert torch.equal(cache, expected_cache_after(batch, before, lambda x, _: x.to(before.dtype)))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("chunk_blocks", [1, 2, 4])
@pytest.mark.parametrize("block_size", [16, 256])
def test_local_attention_matches_chunk_masked_dense(kernel, block_size, chunk_blocks, rng):
    from ray_attn.planner.local import make_local_attention_virtual_batches
    from ray_attn.metadata import LocalAttentionMetadata
    import dataclasses

    head_size, Hk, H = 64, 2, 8
    device, dtype, atol = setup(kernel, head_size, block_size)
    chunk = chunk_blocks * block_size
    q_lens = [1, chunk + 5, 3, 1, 2 * chunk]
    kv_lens = [chunk + 3, chunk + 9, 3 * chunk + 7, 2 * chunk, 3 * chunk]
    impl = FlashAttentionImpl(H, head_size, head_size ** -0.5, Hk, None, None, "auto",
                              use_irope=True, dtype=dtype, block_size=block_size, device=device,
                              kernel=kernel)
    batch = make_batch(q_lens, kv_lens, H=H, Hk=Hk, D=head_size, block_size=block_size,
                       dtype=dtype, gen=rng)
    m = batch.meta
    sq, cuq, sk, bt = make_local_attention_virtual_batches(chunk, m.query_start_loc, m.seq_lens,
                                                           m.block_table, block_size)
    local = LocalAttentionMetadata(local_query_start_loc=cuq, local_seqused_k=sk,
                                   local_block_table=bt, local_max_query_len=int(sq.max()),
                                   local_max_seq_len=int(sk.max()))
    before = batch.kv_cache.clone()
    out, _ = run(impl, batch, device, meta=dataclasses.replace(m, local_attn_metadata=local))
    ref = dense_reference(batch, before, scale=head_size ** -0.5, chunk=chunk)
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=atol)


def test_bfloat16_inputs_on_torch_kernel(rng):
    impl = FlashAttentionImpl(8, 64, 0.125, 2, None, None, "auto", dtype=torch.bfloat16)
    batch = make_batch(MIXED_Q, MIXED_KV, H=8, Hk=2, D=64, block_size=16, dtype=torch.bfloat16, gen=rng)
    before = batch.kv_cache.clone()
    out, _ = run(impl, batch, torch.device("cpu"))
    ref = dense_reference(batch, before, scale=0.125)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def test_profiling_run_returns_output_untouched():
    impl = FlashAttentionImpl(4, 64, 0.125, 4, None, None, "auto", dtype=torch.float32)
    q = torch.randn(3, 4, 64)
    out = torch.full_like(q, 7.0)
    cache = torch.randn(2, 4, 16, 4, 64)
    before = cache.clone()
    assert impl.forward(AttentionLayer(), q, q, q, cache, None, out) is out
    assert torch.equal(out, torch.full_like(q, 7.0)) and torch.equal(cache, before)
    with pytest.raises(ValueError, match="output buffer"):
        impl.forward(AttentionLayer(), q, q, q, cache, None, None)


def test_merge_attn_states_equals_attention_over_the_union(rng):
    """Split keys at a random point: merging the two halves' states gives the whole."""
    T, H, D, K = 5, 3, 16, 40
    q = torch.randn(T, H, D, generator=rng, dtype=torch.float64)
    k = torch.randn(K, H, D, generator=rng, dtype=torch.float64)
    v = torch.randn(K, H, D, generator=rng, dtype=torch.float64)

    def attend(ks, vs):
        s = torch.einsum("qhd,khd->hqk", q, ks)
        return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vs), torch.logsumexp(s, -1)

    from ray_attn.backend import merge_attn_states
    cut = int(torch.randint(1, K - 1, (1,), generator=rng))
    (oa, la), (ob, lb) = attend(k[:cut], v[:cut]), attend(k[cut:], v[cut:])
    full, full_lse = attend(k, v)
    out, out_lse = torch.empty_like(full), torch.empty_like(full_lse)
    merge_attn_states(out, oa, la, ob, lb, out_lse)
    torch.testing.assert_close(out, full)
    torch.testing.assert_close(out_lse, full_lse)
    # An empty state (lse +-inf) has no weight; two empty states give zeros, not NaN.
    inf = torch.full_like(la, float("inf"))
    merge_attn_states(out, torch.randn_like(oa), inf, ob, lb)
    torch.testing.assert_close(out, ob)
    merge_attn_states(out, oa, -inf, ob, -inf)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
@pytest.mark.parametrize("lse_a,lse_b", [(100, 100), (-100, -100), (100, 80), (80, 100)])
def test_merge_attn_states_is_stable_for_large_float32_lse(device, lse_a, lse_b, rng):
    """float32 states whose LSEs sit near +-100, where e^lse overflows (e^89 > float32 max) or
    underflows to subnormals and zero: the merge must still weigh them by their LSE difference.
    On CUDA a float32 merge without output_lse runs the Triton kernel (when Triton imports)."""
    T, H, D, K = 6, 4, 32, 48
    q = torch.randn(T, H, D, generator=rng, dtype=torch.float64)
    k = torch.randn(K, H, D, generator=rng, dtype=torch.float64)
    v = torch.randn(K, H, D, generator=rng, dtype=torch.float64)
    cut = int(torch.randint(1, K - 1, (1,), generator=rng))
    s = torch.einsum("qhd,khd->hqk", q, k) * D ** -0.5
    # Shift each half's scores so that its LSE lands within +-2 of the target; a constant shift
    # leaves that half's softmax alone, so the union of the shifted scores is the exact answer.
    targets = [c + 4 * torch.rand(H, T, 1, generator=rng, dtype=torch.float64) - 2 for c in (lse_a, lse_b)]
    halves = [s[..., :cut], s[..., cut:]]
    halves = [h - torch.logsumexp(h, -1, keepdim=True) + t for h, t in zip(halves, targets)]
    vs = [v[:cut], v[cut:]]
    (oa, la), (ob, lb) = [(torch.einsum("hqk,khd->qhd", torch.softmax(h, -1), x), torch.logsumexp(h, -1))
                          for h, x in zip(halves, vs)]
    union = torch.cat(halves, -1)
    ref = torch.einsum("hqk,khd->qhd", torch.softmax(union, -1), v)
    ref_lse = torch.logsumexp(union, -1)

    from ray_attn.backend import merge_attn_states
    f32 = lambda x: x.to(device, torch.float32).contiguous()
    out = torch.full((T, H, D), float("nan"), device=device)
    # The Triton path writes no LSE, so only the torch path is asked for one.
    out_lse = torch.empty(H, T, device=device) if device == "cpu" else None
    merge_attn_states(out, f32(oa), f32(la), f32(ob), f32(lb), out_lse)
    # Rounding an LSE near 100 to float32 moves it by <= 3.8e-6 (half an ulp), so each weight
    # moves by <= 2e-6 and the output by that times |o_a - o_b| (a few units): ~1e-5.  1e-4
    # leaves room for float32 arithmetic; an unshifted exp gives NaN, zeros or errors ~1e-2.
    torch.testing.assert_close(out.double().cpu(), ref, atol=1e-4, rtol=1e-4)
    if out_lse is not None:
        # The merged LSE is a float32 near 100: an ulp is 7.6e-6.
        torch.testing.assert_close(out_lse.double(), ref_lse, atol=1e-4, rtol=0)
