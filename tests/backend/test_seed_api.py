"""The backend called the way vLLM's seed calls it: cascade metadata as vLLM's builder fills it
(``use_cascade``, ``common_prefix_len``, ``cu_prefix_query_lens``, ``prefix_kv_lens``,
``suffix_kv_lens``; no prefix/suffix block tables), on every kernel; and bad metadata that must be
refused on the host with an error naming the field, never reach a kernel (issue 13: FA3 crashed
the process with SIGSEGV on the seed's cascade metadata, FA2 raised an unrelated error, the torch
kernel a TypeError)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from ray_attn.backend import AttentionLayer, FlashAttentionImpl
from ray_attn.backend.cache import FP8_DTYPE, quantize_fp8, reshape_and_cache_flash
from ray_attn.metadata import LocalAttentionMetadata
from tests.backend.batch import dense_reference, expected_cache_after, make_batch
from tests.backend.test_flash_attn import GPU, run, setup

KERNELS = [pytest.param("torch", id="torch"), pytest.param("fa2", marks=GPU, id="fa2"),
           pytest.param("fa3", marks=GPU, id="fa3")]
H, HK, D = 8, 2, 128


def block_size_for(kernel: str) -> int:
    return 256 if kernel == "fa2" else 16


def seed_cascade(batch, prefix_blocks: int, block_size: int):
    """The fields vLLM's FlashAttentionMetadataBuilder sets for one shared prefix, and no more."""
    m = batch.meta
    c = prefix_blocks * block_size
    return dataclasses.replace(
        m, use_cascade=True, common_prefix_len=c,
        cu_prefix_query_lens=np.array([0, m.num_actual_tokens], np.int32),
        prefix_kv_lens=np.array([c], np.int32),
        suffix_kv_lens=(m.seq_lens - c).astype(np.int32))


def shared_batch(kernel, rng, q_lens, extra, prefix_blocks=2, dtype=None):
    bs = block_size_for(kernel)
    device, dt, atol = setup(kernel, D, bs)
    kv_lens = [prefix_blocks * bs + e for e in extra]
    batch = make_batch(q_lens, kv_lens, H=H, Hk=HK, D=D, block_size=bs, dtype=dtype or dt, gen=rng,
                       groups=[(prefix_blocks, list(range(len(q_lens))))])
    impl = FlashAttentionImpl(H, D, D ** -0.5, HK, None, None, "auto", dtype=dtype or dt, block_size=bs,
                              device=device, kernel=kernel)
    return impl, batch, device, atol, bs


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shape", ["decode", "with_prefill"])
def test_seed_cascade_metadata_matches_dense(kernel, shape, rng):
    q_lens, extra = ([1] * 6, [1, 5, 9, 30, 2, 17]) if shape == "decode" else ([1, 7, 1, 12], [3, 7, 40, 12])
    impl, batch, device, atol, bs = shared_batch(kernel, rng, q_lens, extra)
    before = batch.kv_cache.clone()
    meta = seed_cascade(batch, 2, bs)
    out, _ = run(impl, batch, device, meta=meta)
    ref = dense_reference(batch, before, scale=D ** -0.5)
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=atol)
    plain, _ = run(impl, batch, device)
    torch.testing.assert_close(out, plain, atol=atol, rtol=atol)


def test_seed_cascade_tables_are_the_seeds_slices(rng):
    """Derived exactly as vLLM's cascade_attention reads them: the prefix from the first row,
    the suffix from the columns after the shared blocks."""
    impl, batch, device, _, bs = shared_batch("torch", rng, [1] * 4, [3, 9, 20, 40], prefix_blocks=3)
    meta = seed_cascade(batch, 3, bs).to_device(device)
    out = torch.empty_like(batch.query)
    impl.forward(AttentionLayer(), batch.query, batch.key, batch.value, batch.kv_cache, meta, out)
    bt = torch.from_numpy(batch.meta.block_table)
    assert torch.equal(meta.prefix_block_table, bt[:1, :3])
    assert torch.equal(meta.suffix_block_table, bt[:, 3:])
    assert meta.max_suffix_kv_len == max(batch.kv_lens) - 3 * bs


def _bad_case(name, batch, bs):
    """(metadata, local metadata or None, impl kwargs, expected message) for one bad input."""
    m = seed_cascade(batch, 2, bs)
    r = dataclasses.replace
    if name == "multi_group_without_tables":
        n = m.num_actual_tokens
        return r(m, cu_prefix_query_lens=np.array([0, 2, n], np.int32),
                 prefix_kv_lens=np.array([2 * bs, 2 * bs], np.int32)), {}, "cu_prefix_query_lens must have 2 entries"
    if name == "prefix_not_whole_blocks":
        return r(m, common_prefix_len=2 * bs - 3), {}, "multiple of block_size"
    if name == "suffix_missing":
        return r(m, suffix_kv_lens=None), {}, "suffix_kv_lens is missing"
    if name == "suffix_wrong":
        s = m.suffix_kv_lens.copy(); s[1] += 1
        return r(m, suffix_kv_lens=s), {}, "sequence 1: suffix_kv_lens"
    if name == "prefix_past_queries":
        # the shared prefix may not reach into a request's queries (its suffix holds them)
        c = 3 * bs
        return r(m, common_prefix_len=c, prefix_kv_lens=np.array([c], np.int32),
                 suffix_kv_lens=(m.seq_lens - c).astype(np.int32)), {}, "shorter than its query length"
    if name == "groups_split_a_request":
        return r(m, cu_prefix_query_lens=np.array([0, 2, m.num_actual_tokens], np.int32),
                 prefix_kv_lens=np.array([2 * bs, 2 * bs], np.int32),
                 prefix_block_table=np.asarray(m.block_table[:2, :2]),
                 suffix_block_table=np.asarray(m.block_table[:, 2:]), max_suffix_kv_len=999), {}, "splits a request"
    if name == "window_clips_prefix":
        return m, {"sliding_window": 8}, "sliding_window=8"
    if name == "alibi":
        return m, {"alibi_slopes": [0.5] * H}, "ALiBi"
    if name == "int64_arrays":  # made int64 after to_device, which would convert it
        return batch.meta, {}, "seq_lens must be int32"
    if name == "local_table_narrow":
        loc = LocalAttentionMetadata(
            local_query_start_loc=batch.meta.query_start_loc, local_seqused_k=batch.meta.seq_lens,
            local_block_table=np.zeros((len(batch.q_lens), 1), np.int32),
            local_max_query_len=batch.meta.max_query_len, local_max_seq_len=batch.meta.max_seq_len)
        return r(batch.meta, local_attn_metadata=loc), {"use_irope": True}, "local_block_table has 1 columns"
    if name == "local_missing_field":
        loc = LocalAttentionMetadata(local_query_start_loc=batch.meta.query_start_loc, local_seqused_k=None,
                                     local_block_table=batch.meta.block_table, local_max_query_len=1,
                                     local_max_seq_len=1)
        return r(batch.meta, local_attn_metadata=loc), {"use_irope": True}, "local_seqused_k is missing"
    raise AssertionError(name)


BAD = ["multi_group_without_tables", "prefix_not_whole_blocks", "suffix_missing", "suffix_wrong",
       "prefix_past_queries", "groups_split_a_request", "window_clips_prefix", "alibi", "int64_arrays",
       "local_table_narrow", "local_missing_field"]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", BAD)
def test_bad_metadata_is_refused_on_the_host(kernel, name, rng):
    """Metadata on the device (as a direct caller would pass it): values are read back once and
    checked before any kernel or cache write."""
    if name == "alibi" and kernel == "fa3":
        pytest.skip("FA3 has no ALiBi: the constructor refuses it first")
    impl, batch, device, _, bs = shared_batch(kernel, rng, [1, 2, 1, 3], [3, 9, 20, 40])
    meta, kw, match = _bad_case(name, batch, bs)
    if kw:
        impl = FlashAttentionImpl(H, D, D ** -0.5, HK, kw.get("alibi_slopes"), kw.get("sliding_window"),
                                  "auto", use_irope=kw.get("use_irope", False), dtype=impl.dtype,
                                  block_size=bs, device=device, kernel=kernel)
    cache = batch.kv_cache.to(device)
    before = cache.clone()
    out = torch.empty_like(batch.query, device=device)
    dm = meta.to_device(device)
    if name == "int64_arrays":
        dm.seq_lens = dm.seq_lens.long()
    with pytest.raises(ValueError, match=match):
        impl.forward(AttentionLayer(device=device), batch.query.to(device), batch.key.to(device),
                     batch.value.to(device), cache, dm, out)
    assert torch.equal(cache, before), "a refused call must not write the cache"


def test_numpy_metadata_is_refused(rng):
    impl, batch, device, _, bs = shared_batch("torch", rng, [1, 2], [3, 9])
    out = torch.empty_like(batch.query)
    with pytest.raises(ValueError, match="query_start_loc must be a torch.Tensor"):
        impl.forward(AttentionLayer(), batch.query, batch.key, batch.value, batch.kv_cache, batch.meta, out)


# -- vLLM's slot mapping: int64, padded with -1 ------------------------------------------------
# vLLM's block table keeps ``slot_mapping`` in int64 and pads it with PAD_SLOT_ID = -1, which its
# cache write skips (issue 22: we refused int64 on every kernel).

def vllm_slot_mapping(meta, dtype, device, pad: int) -> torch.Tensor:
    """The slot mapping as vLLM's runner hands it over: a device tensor of ``dtype``, -1 past the
    real tokens."""
    real = np.asarray(meta.slot_mapping[:meta.num_actual_tokens], np.int64)
    return torch.from_numpy(np.concatenate([real, np.full(pad, -1, np.int64)])).to(device, dtype)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("cascade", [False, True], ids=["plain", "seed_cascade"])
def test_vllm_slot_mapping_any_width_padded(kernel, slot_dtype, cascade, rng):
    """The seed's call: query/key/value padded past num_actual_tokens, the slot mapping int32 or
    int64 with -1 padding; output equals float64 dense attention, the cache changes at exactly the
    real tokens' slots, and the padding rows are left alone."""
    pad = 5
    bs = block_size_for(kernel)
    device, dt, atol = setup(kernel, D, bs)
    q_lens, extra = [1, 7, 1, 12], [3, 7, 40, 12]
    batch = make_batch(q_lens, [2 * bs + e for e in extra], H=H, Hk=HK, D=D, block_size=bs, dtype=dt,
                       gen=rng, groups=[(2, list(range(4)))], pad_tokens=pad)
    impl = FlashAttentionImpl(H, D, D ** -0.5, HK, None, None, "auto", dtype=dt, block_size=bs,
                              device=device, kernel=kernel)
    meta = seed_cascade(batch, 2, bs) if cascade else batch.meta
    dm = meta.to_device(device)
    dm.slot_mapping = vllm_slot_mapping(meta, slot_dtype, device, pad)
    cache, before = batch.kv_cache.to(device), batch.kv_cache.clone()
    out = torch.full_like(batch.query, float("nan"), device=device)
    impl.forward(AttentionLayer(device=device), batch.query.to(device), batch.key.to(device),
                 batch.value.to(device), cache, dm, out)
    n = batch.meta.num_actual_tokens
    ref = dense_reference(batch, before, scale=D ** -0.5)
    torch.testing.assert_close(out[:n].cpu().double(), ref, atol=atol, rtol=atol)
    assert out[n:].isnan().all(), "padding rows must be left as they were"
    assert torch.equal(cache.cpu(), expected_cache_after(batch, before, lambda x, _: x.to(before.dtype)))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_cache_write_skips_negative_slots(device, slot_dtype, kv_cache_dtype):
    """reshape_and_cache_flash (the torch write on CPU, the Triton kernel on CUDA): a token whose
    slot is negative leaves the cache byte for byte as it was; every other token lands in its slot
    (rounded to e4m3 with an fp8 cache)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 31)))
    nb, bs, hk, d, T = 6, 16, 2, 64, 12
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    fp8 = kv_cache_dtype == "fp8"
    cache = torch.randn(2, nb, bs, hk, d, generator=gen).to(FP8_DTYPE if fp8 else dtype).to(device)
    before = cache.clone()
    key, value = (torch.randn(T, hk, d, generator=gen).to(dtype).to(device) for _ in range(2))
    slots = torch.randperm(nb * bs, generator=gen)[:T]
    slots[[2, 7]] = -1  # vLLM's padding, mid-batch as well as at the end
    slots[T - 1] = -1
    sm = slots.to(device, slot_dtype)
    scale = 0.5
    reshape_and_cache_flash(key, value, cache[0], cache[1], sm, kv_cache_dtype, scale, scale)
    exp = before.cpu().clone()
    keep = slots >= 0
    flat = exp.view(2, nb * bs, hk, d)
    store = (lambda x: quantize_fp8(x.cpu(), scale)) if fp8 else (lambda x: x.cpu())
    flat[0, slots[keep]] = store(key[keep.to(device)])
    flat[1, slots[keep]] = store(value[keep.to(device)])
    got = cache.cpu()
    assert torch.equal(got.view(torch.uint8), exp.view(torch.uint8)), "only the non-negative slots change"


def test_to_device_keeps_an_int64_slot_mapping(rng):
    """A vLLM-style int64 numpy slot mapping stays int64 (no narrowing); the planner's int32 stays."""
    _, batch, _, _, _ = shared_batch("torch", rng, [1, 2], [3, 9])
    assert batch.meta.to_device("cpu").slot_mapping.dtype == torch.int32
    wide = dataclasses.replace(batch.meta, slot_mapping=batch.meta.slot_mapping.astype(np.int64))
    t = wide.to_device("cpu")
    assert t.slot_mapping.dtype == torch.int64 and t.seq_lens.dtype == torch.int32
