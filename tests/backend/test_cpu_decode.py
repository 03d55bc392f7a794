"""The batched pure-decode path of the torch kernel (``backend/cpu_decode.py``) against the
per-sequence reference run in float64: GQA, ragged lengths, page ids past a sequence's end,
sliding windows, soft cap, fp16/bf16 caches, and the LSE.  Tolerance 1e-5 (float32 math
over <= 300 keys of unit-scale scores; a wrong mask or head mapping moves outputs by ~1e-1).
"""

from __future__ import annotations

import pytest
import torch

from ray_attn.backend import cpu_decode
from ray_attn.backend.kernels import TorchKernel
from ray_attn.backend.reference import paged_attention_ref

ATOL = 1e-5


def case(rng, lens, heads=8, kv_heads=2, dim=32, block=16, dtype=torch.float32):
    num_blocks = sum(-(-n // block) for n in lens) + 3
    k = torch.randn(num_blocks, block, kv_heads, dim, generator=rng).to(dtype)
    v = torch.randn(num_blocks, block, kv_heads, dim, generator=rng).to(dtype)
    perm = torch.randperm(num_blocks, generator=rng)
    width = max(-(-n // block) for n in lens) + 1  # one page id past every sequence: must be ignored
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        pages = -(-n // block)
        table[b, :pages] = perm[used:used + pages]
        table[b, pages:] = perm[-1]  # a page of other (nonzero) keys
        used += pages
    q = torch.randn(len(lens), heads, dim, generator=rng)
    return q, k, v, table, torch.tensor(lens, dtype=torch.int32)


def check_against_reference(q, k, v, table, kv_lens, cu, window, softcap, return_lse, **kw):
    """The batched path against the float64 reference loop: outputs and (when asked) the LSE."""
    got, lse = cpu_decode.paged_decode(q, k, v, seqused_k=kv_lens, block_table=table, scale=0.3, window_size=window,
                                       softcap=softcap, return_lse=return_lse, **kw)
    want, want_lse = paged_attention_ref(q.double(), k.double(), v.double(), cu_seqlens_q=cu, seqused_k=kv_lens,
                                         block_table=table, scale=0.3, causal=True, window_size=window,
                                         softcap=softcap, compute_dtype=torch.float64)
    assert (got.double() - want).abs().max().item() < ATOL
    if return_lse:
        assert (lse.double() - want_lse).abs().max().item() < ATOL
    assert want.std() > 0.1


@pytest.mark.parametrize("window,softcap,dtype", [((-1, -1), 0.0, torch.float32), ((20, 0), 0.0, torch.float32),
                                                  ((-1, -1), 5.0, torch.bfloat16), ((7, -1), 0.0, torch.float16)])
@pytest.mark.parametrize("return_lse", [True, False])  # False: torch's fused SDPA (without a soft cap)
def test_batched_decode_equals_the_float64_reference(rng, window, softcap, dtype, return_lse):
    lens = [1, 17, 300, 64, 33]
    q, k, v, table, kv_lens = case(rng, lens, dtype=dtype)
    cu = torch.arange(len(lens) + 1, dtype=torch.int32)
    assert cpu_decode.supports(q, k, cu, 1, None, torch.float32)
    check_against_reference(q, k, v, table, kv_lens, cu, window, softcap, return_lse)


def test_the_torch_kernel_takes_the_batched_path_only_for_decode_and_verification(rng, monkeypatch):
    lens = [5, 40]
    q, k, v, table, kv_lens = case(rng, lens)
    calls = []
    real = cpu_decode.paged_decode
    monkeypatch.setattr(cpu_decode, "paged_decode", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    kern, out = TorchKernel(), torch.empty_like(q)
    kw = dict(seqused_k=kv_lens, max_seqlen_k=40, block_table=table, scale=0.2, causal=True, return_lse=True)
    lse = kern.varlen_paged(q, k, v, out, cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32), max_seqlen_q=1, **kw)
    assert calls == [1]
    want, want_lse = paged_attention_ref(q, k, v, cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32),
                                         seqused_k=kv_lens, block_table=table, scale=0.2, causal=True)
    assert (out - want).abs().max().item() < ATOL and (lse - want_lse).abs().max().item() < ATOL
    out2 = torch.empty_like(q)
    assert kern.varlen_paged(q, k, v, out2, cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32), max_seqlen_q=1,
                             **(kw | {"return_lse": False})) is None
    assert calls == [1, 1] and (out2 - want).abs().max().item() < ATOL
    # A verifying step (two queries for the second sequence) is batched too; a prefill chunk
    # longer than MAX_QUERY, ALiBi and float64 run the reference loop.
    q3 = torch.cat([q, q[1:]])
    kern.varlen_paged(q3, k, v, torch.empty_like(q3), cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32),
                      max_seqlen_q=2, **kw)
    assert calls == [1, 1, 1]
    n = cpu_decode.MAX_QUERY + 1
    q4 = torch.randn(n + 1, 8, 32, generator=rng)
    kern.varlen_paged(q4, k, v, torch.empty_like(q4), cu_seqlens_q=torch.tensor([0, 1, n + 1], dtype=torch.int32),
                      max_seqlen_q=n, **kw)
    kern.varlen_paged(q, k, v, out, cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32), max_seqlen_q=1,
                      alibi_slopes=torch.ones(8), **kw)
    kern.varlen_paged(q.double(), k.double(), v.double(), out.double(),
                      cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32), max_seqlen_q=1, **kw)
    assert calls == [1, 1, 1]


@pytest.mark.parametrize("window,softcap,dtype", [((-1, -1), 0.0, torch.float32), ((20, 0), 0.0, torch.float32),
                                                  ((-1, -1), 5.0, torch.bfloat16), ((3, -1), 0.0, torch.float16)])
@pytest.mark.parametrize("return_lse", [True, False])
def test_verifying_queries_equal_the_float64_reference(rng, window, softcap, dtype, return_lse):
    """Ragged causal queries at the end of each sequence (1 + k drafts; one sequence with none in
    this step): the causal mask among the drafts, each query's own window, the LSE per token."""
    lens, q_lens = [1, 17, 300, 64, 33, 9], [1, 3, 5, 2, 0, 4]
    q, k, v, table, kv_lens = case(rng, lens, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), 8, 32, generator=rng)
    assert cpu_decode.supports(q, k, cu, max(q_lens), None, torch.float32)
    assert not cpu_decode.supports(q, k, cu, max(q_lens), None, torch.float32, causal=False)
    check_against_reference(q, k, v, table, kv_lens, cu, window, softcap, return_lse, cu_seqlens_q=cu,
                            max_seqlen_q=max(q_lens))


def test_a_steps_plan_is_built_once_and_serves_every_layer(rng, monkeypatch):
    """Through ``TorchKernel``: two layers of one step (one ``plans`` dict, as the step's
    metadata keeps it) build the gather indices and masks once and give what a fresh plan
    gives; another step's lengths (a new dict) get their own plan, not the first step's."""
    lens = [37, 5, 64, 18]
    q, k, v, table, kv_lens = case(rng, lens)
    built = []
    real = cpu_decode._build_plan
    monkeypatch.setattr(cpu_decode, "_build_plan", lambda *a: built.append(a) or real(*a))
    cu = torch.arange(len(lens) + 1, dtype=torch.int32)
    kernel, plans = TorchKernel(), TorchKernel().scheduler_metadata()

    def layer(lengths, plans):
        out = torch.empty_like(q)
        kernel.varlen_paged(q, k, v, out, cu_seqlens_q=cu, max_seqlen_q=1, seqused_k=lengths,
                            max_seqlen_k=int(lengths.max()), block_table=table, scale=0.3, causal=True,
                            scheduler_metadata=plans)
        return out

    first, second = layer(kv_lens, plans), layer(kv_lens, plans)
    assert len(built) == 1 and len(plans) == 1
    assert torch.equal(first, second)
    assert torch.allclose(first, layer(kv_lens, None), atol=ATOL)
    shorter = kv_lens - 3  # the next step's metadata: its own plans
    want = layer(shorter, None)
    assert torch.allclose(layer(shorter, TorchKernel().scheduler_metadata()), want, atol=ATOL)
    assert not torch.allclose(want, first, atol=1e-3)
