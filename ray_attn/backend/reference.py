"""Exact paged varlen attention in plain torch: the CPU kernel and the oracle for the GPU kernels.

It follows FlashAttention's conventions to the letter, so that the three kernels are swappable:
- queries are bottom-right aligned: query ``i`` of a sequence with ``q`` queries and ``k`` keys
  sits at position ``i + k - q``;
- ``window_size=(left, right)`` keeps keys in ``[pos - left, pos + right]`` (-1 = unbounded);
- soft cap is ``cap * tanh(scale * q.k / cap)``, then ALiBi adds ``-slope * |pos - j|``;
- the LSE is natural-log, laid out ``[num_heads, num_tokens]``, and ``-inf`` for a row with no key.
One Python iteration per sequence is fine here: this path serves CPU tests and small CPU models.
"""

from __future__ import annotations

import torch


def gather_paged(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of a sequence whose pages are ``blocks``: [length, heads, dim]."""
    if cache.dtype.itemsize == 1 and cache.dtype.is_floating_point:
        # float8 indexing is not implemented for every CPU op; move the bytes as uint8.
        return cache.view(torch.uint8)[blocks].view(cache.dtype).flatten(0, 1)[:length]
    return cache[blocks].flatten(0, 1)[:length]


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    causal: bool,
    window_size: tuple[int, int] = (-1, -1),
    alibi_slopes: torch.Tensor | None = None,
    softcap: float = 0.0,
    k_descale: float = 1.0,
    v_descale: float = 1.0,
    out: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` [T, H, D] over a paged cache [num_blocks, block_size, Hk, D].

    Returns ``(out, lse)``; ``out`` is written in place when given.
    """
    num_tokens, num_heads, _ = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty(q.shape[0], num_heads, v_cache.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.full((num_heads, num_tokens), float("-inf"), dtype=torch.float32, device=q.device)
    cu = cu_seqlens_q.tolist()
    kv_lens = seqused_k.tolist()
    left, right = window_size
    slopes = None if alibi_slopes is None else alibi_slopes.to(q.device, compute_dtype)[:, None, None]
    for b, k_len in enumerate(kv_lens):
        q_start, q_end = cu[b], cu[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        blocks = block_table[b, : -(-k_len // block_size)].long()
        k = gather_paged(k_cache, blocks, k_len).to(compute_dtype) * k_descale
        v = gather_paged(v_cache, blocks, k_len).to(compute_dtype) * v_descale
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[q_start:q_end].to(compute_dtype), k) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        q_pos = torch.arange(q_len, device=q.device)[:, None] + (k_len - q_len)
        k_pos = torch.arange(k_len, device=q.device)[None, :]
        if slopes is not None:
            s = s - slopes * (q_pos - k_pos).abs().to(compute_dtype)
        keep = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device)
        if causal:
            keep &= k_pos <= q_pos
        if left >= 0:
            keep &= k_pos >= q_pos - left
        if right >= 0:
            keep &= k_pos <= q_pos + right
        s = s.masked_fill(~keep, float("-inf"))
        row_lse = torch.logsumexp(s, dim=-1)  # [H, q]
        # A fully masked row has lse -inf; exp(-inf - -inf) would be nan, so shift it to 0 instead.
        p = torch.exp(s - torch.where(row_lse.isinf(), 0.0, row_lse)[..., None])
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", p, v).to(out.dtype)
        lse[:, q_start:q_end] = row_lse.float()
    return out, lse
