"""Random paged batches for the backend tests, with their dense float64 truth.

Written independently of the planner and of the reference kernel: the block allocation here is a
random permutation, and the oracle below is plain dense attention over contiguous K/V.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ray_attn.metadata import FlashAttentionMetadata


def cdiv(a, b):
    return -(-a // b)


@dataclass
class Batch:
    query: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, Hk, D] this step's new keys
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, NB, BS, Hk, D]
    meta: FlashAttentionMetadata  # numpy arrays
    q_lens: list
    kv_lens: list
    block_rows: list  # block ids per request


def make_batch(q_lens, kv_lens, *, H, Hk, D, block_size, dtype, gen, groups=None,
               cache_dtype=None, num_blocks=None, pad_tokens=0) -> Batch:
    """``groups``: list of (num_shared_blocks, [request indices]); members share those blocks."""
    B = len(q_lens)
    need = [cdiv(k, block_size) for k in kv_lens]
    total = sum(need) + 3
    num_blocks = num_blocks or total
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    rows = [[] for _ in range(B)]
    for n_shared, members in groups or []:
        shared = [perm.pop() for _ in range(n_shared)]
        for b in members:
            rows[b] = list(shared)
    for b in range(B):
        while len(rows[b]) < need[b]:
            rows[b].append(perm.pop())
    width = max(need) + 1
    block_table = np.zeros((B, width), np.int32)
    for b, r in enumerate(rows):
        block_table[b, : len(r)] = r
    T = sum(q_lens)
    slots = []
    for b in range(B):
        for pos in range(kv_lens[b] - q_lens[b], kv_lens[b]):
            slots.append(rows[b][pos // block_size] * block_size + pos % block_size)
    slot_mapping = np.array(slots + [-1] * pad_tokens, np.int32)
    qsl = np.zeros(B + 1, np.int32)
    qsl[1:] = np.cumsum(q_lens)
    meta = FlashAttentionMetadata(
        num_actual_tokens=T, max_query_len=max(q_lens), query_start_loc=qsl,
        max_seq_len=max(kv_lens), seq_lens=np.array(kv_lens, np.int32),
        block_table=block_table, slot_mapping=slot_mapping)
    randn = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float32)
    kv_cache = randn(2, num_blocks, block_size, Hk, D)
    kv_cache = kv_cache.to(cache_dtype or dtype)
    return Batch(query=randn(T + pad_tokens, H, D).to(dtype), key=randn(T + pad_tokens, Hk, D).to(dtype),
                 value=randn(T + pad_tokens, Hk, D).to(dtype), kv_cache=kv_cache, meta=meta,
                 q_lens=list(q_lens), kv_lens=list(kv_lens), block_rows=rows)


def add_cascade(batch: Batch, groups, block_size: int) -> FlashAttentionMetadata:
    """Cascade metadata for ``groups`` (contiguous members, in batch order)."""
    m = batch.meta
    G = len(groups)
    cu = np.zeros(G + 1, np.int32)
    prefix_lens, prefix_rows = [], []
    suffix_rows, suffix_lens = [], []
    for g, (n_shared, members) in enumerate(groups):
        cu[g + 1] = cu[g] + sum(batch.q_lens[b] for b in members)
        prefix_lens.append(n_shared * block_size)
        prefix_rows.append(batch.block_rows[members[0]][:n_shared])
        for b in members:
            suffix_rows.append(batch.block_rows[b][n_shared:])
            suffix_lens.append(batch.kv_lens[b] - n_shared * block_size)

    def table(rows):
        t = np.zeros((len(rows), max(len(r) for r in rows) + 1), np.int32)
        for i, r in enumerate(rows):
            t[i, : len(r)] = r
        return t

    import dataclasses
    return dataclasses.replace(
        m, use_cascade=True, common_prefix_len=max(prefix_lens), cu_prefix_query_lens=cu,
        prefix_kv_lens=np.array(prefix_lens, np.int32), prefix_block_table=table(prefix_rows),
        suffix_kv_lens=np.array(suffix_lens, np.int32), suffix_block_table=table(suffix_rows),
        max_suffix_kv_len=max(suffix_lens))


def dequant(x: torch.Tensor, scale: float) -> torch.Tensor:
    return x.to(torch.float64) * scale


def dense_reference(batch: Batch, cache_before: torch.Tensor, *, scale, window=None, alibi=None,
                    softcap=0.0, chunk=None, k_scale=1.0, v_scale=1.0, new_kv_as_stored=None):
    """float64 dense attention per request over contiguous K/V; returns [T, H, D].

    Context K/V come from ``cache_before`` (what was stored), new K/V from ``new_kv_as_stored``
    (the new keys as the cache stores them, e.g. after fp8 rounding) or the raw inputs.
    """
    H = batch.query.shape[1]
    Hk = batch.key.shape[1]
    bs = cache_before.shape[2]
    new_k, new_v = new_kv_as_stored or (batch.key.double(), batch.value.double())
    outs = []
    t0 = 0
    for b, (ql, kl) in enumerate(zip(batch.q_lens, batch.kv_lens)):
        ctx = kl - ql
        rows = batch.block_rows[b]
        pos = torch.arange(ctx)
        blk = torch.tensor([rows[p // bs] for p in range(ctx)], dtype=torch.long)
        off = pos % bs
        k = torch.cat([dequant(cache_before[0, blk, off], k_scale), new_k[t0:t0 + ql].double()])
        v = torch.cat([dequant(cache_before[1, blk, off], v_scale), new_v[t0:t0 + ql].double()])
        q = batch.query[t0:t0 + ql].double()
        outs.append(dense_attention(q, k, v, torch.arange(ctx, kl), scale=scale, window=window,
                                    chunk=chunk, softcap=softcap, alibi=alibi))
        t0 += ql
    return torch.cat(outs)


def dense_attention(q, k, v, q_pos, *, scale, window=None, chunk=None, softcap=0.0, alibi=None):
    """Causal attention of queries at positions ``q_pos`` over keys at positions 0..len(k)-1,
    written plainly (no paging, no kernel conventions): q [q, H, D], k/v [k, Hk, D]."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    qp = torch.as_tensor(q_pos)[:, None]
    kp = torch.arange(k.shape[0])[None, :]
    if alibi is not None:
        s = s - torch.tensor(alibi, dtype=s.dtype)[:, None, None] * (qp - kp).abs()
    mask = kp <= qp
    if window is not None:
        mask &= kp > qp - window
    if chunk is not None:
        mask &= (kp // chunk) == (qp // chunk)
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)


def expected_cache_after(batch: Batch, cache_before: torch.Tensor, store) -> torch.Tensor:
    """The cache with exactly this step's slots overwritten by ``store(new_k)``."""
    exp = cache_before.clone()
    n = batch.meta.num_actual_tokens
    slots = torch.from_numpy(batch.meta.slot_mapping[:n]).long()
    keep = slots >= 0
    flat = exp.view(2, -1, *exp.shape[3:])
    flat[0, slots[keep]] = store(batch.key[:n][keep], 0)
    flat[1, slots[keep]] = store(batch.value[:n][keep], 1)
    return exp
