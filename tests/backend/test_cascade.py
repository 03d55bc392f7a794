"""``cascade_attention`` called directly: the prefix pass's split count, and the scratch buffers
it keeps between calls (they must survive changing shapes, inference mode and CUDA graphs)."""

from __future__ import annotations

import pytest
import torch

from ray_attn.backend import FlashAttentionImpl
from ray_attn.backend import flash_attn
from ray_attn.backend.flash_attn import cascade_attention
from tests.backend.batch import add_cascade, dense_reference, make_batch
from tests.backend.test_flash_attn import GPU, run, setup

H, HK, D, BS = 8, 2, 128, 16
KERNELS = [pytest.param("torch", id="torch"), pytest.param("fa3", marks=GPU, id="fa3")]


def make_case(kernel, rng, num_reqs=6, shared_blocks=None, groups=1):
    """A decode batch whose requests share a prefix, the cache after this step's write, and the
    float64 truth.  On FA3 the prefix spans ~20 KV tiles, so that 16 splits all get work; the torch
    kernel ignores splits and gets a shorter one."""
    shared_blocks = shared_blocks or (160 if kernel == "fa3" else 40)
    device, dtype, atol = setup(kernel, D, BS)
    impl = FlashAttentionImpl(H, D, D ** -0.5, HK, None, None, "auto", dtype=dtype, block_size=BS,
                              device=device, kernel=kernel)
    per = -(-num_reqs // groups)
    members = [list(range(g * per, min((g + 1) * per, num_reqs))) for g in range(groups)]
    group_list = [(shared_blocks - 3 * g, m) for g, m in enumerate(members) if m]
    kv_lens = [shared_blocks * BS + 2 + 9 * i for i in range(num_reqs)]
    batch = make_batch([1] * num_reqs, kv_lens, H=H, Hk=HK, D=D, block_size=BS, dtype=dtype,
                       gen=rng, groups=group_list)
    before = batch.kv_cache.clone()
    plain, cache = run(impl, batch, device)  # also writes this step's K/V into the cache
    ref = dense_reference(batch, before, scale=D ** -0.5)
    meta = add_cascade(batch, group_list, BS).to_device(device)
    return impl, batch, cache.to(device), meta, plain, ref, atol


def cascade(impl, batch, cache, meta, splits=0):
    n = batch.meta.num_actual_tokens
    out = torch.full_like(batch.query, float("nan"), device=cache.device)
    kc, vc = cache.unbind(0)
    cascade_attention(out[:n], batch.query.to(cache.device)[:n], kc, vc, kernel=impl.kernel,
                      attn_metadata=meta, scale=impl.scale, alibi_slopes=None,
                      sliding_window=(-1, -1), softcap=0.0, prefix_num_splits=splits)
    return out


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("splits", [0, 4, 16])
def test_prefix_splits_equal_plain(kernel, groups, splits, rng):
    impl, batch, cache, meta, plain, ref, atol = make_case(kernel, rng, groups=groups)
    out = cascade(impl, batch, cache, meta, splits).cpu()
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=atol)
    torch.testing.assert_close(out, plain, atol=atol, rtol=atol)


def test_scratch_survives_shape_changes_and_inference_mode(rng, monkeypatch):
    big = make_case("torch", rng, num_reqs=6)
    small = make_case("torch", rng, num_reqs=3, shared_blocks=5, groups=2)
    # The first call of a shape under inference_mode must not leave a buffer that an ordinary
    # call can no longer write.
    with torch.inference_mode():
        cascade(*big[:4])
    for impl, batch, cache, meta, plain, ref, atol in (big, small, big, small):
        torch.testing.assert_close(cascade(impl, batch, cache, meta).double(), ref, atol=atol, rtol=atol)
    # Above the kept sizes, a call allocates instead.
    monkeypatch.setattr(flash_attn, "_SCRATCH_MAX_TOKENS", 4)
    impl, batch, cache, meta, plain, ref, atol = make_case("torch", rng, num_reqs=7)
    torch.testing.assert_close(cascade(impl, batch, cache, meta).double(), ref, atol=atol, rtol=atol)
    assert not any(k[0] == 7 for k in flash_attn._scratch_views)


@GPU
def test_captured_cascade_replays_correctly_after_other_shapes(rng):
    """A graph bakes in its scratch addresses: eager calls of other sizes afterwards must not
    free or move them."""
    impl, batch, cache, meta, plain, ref, atol = make_case("fa3", rng, num_reqs=6)
    n = batch.meta.num_actual_tokens
    q = batch.query.to(cache.device)
    out = torch.zeros_like(q)
    kc, vc = cache.unbind(0)
    call = lambda: cascade_attention(out[:n], q[:n], kc, vc, kernel=impl.kernel, attn_metadata=meta,
                                     scale=impl.scale, alibi_slopes=None, sliding_window=(-1, -1),
                                     softcap=0.0, prefix_num_splits=4)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for num_reqs in (40, 3, 600):  # other buckets, bigger and smaller
        other = make_case("fa3", rng, num_reqs=num_reqs, shared_blocks=4)
        torch.testing.assert_close(cascade(*other[:4]).cpu().double(), other[5], atol=atol, rtol=atol)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.cpu().double(), ref, atol=atol, rtol=atol)
