"""Pure-decode paged attention for the torch kernel, batched: one gather of every sequence's pages
and two einsums for the whole batch, instead of ``reference.paged_attention_ref``'s Python loop of
~10 small ops per sequence.

On CPU the loop cost more than the model's matmuls: SmolLM2-135M at batch 8 and ~300 tokens of
context spent 38 of 60 s in it (scripts/bench_cpu_vs_hf.py; per-op overhead, not arithmetic).
Same conventions and results as the reference (float32 math; the LSE ``[heads, tokens]``,
natural log); the reference stays the oracle and runs everything this does not take
(``supports``): prefill and mixed steps, ALiBi, fp8 caches, float64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def supports(q: torch.Tensor, k_cache: torch.Tensor, cu_seqlens_q: torch.Tensor, max_seqlen_q: int,
             alibi_slopes, compute_dtype: torch.dtype) -> bool:
    """One query per sequence (a pure decode step), no ALiBi, a float16/bfloat16/float32 cache."""
    return (max_seqlen_q == 1 and q.shape[0] == cu_seqlens_q.shape[0] - 1 and alibi_slopes is None
            and compute_dtype == torch.float32 and k_cache.dtype.itemsize > 1)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, seqused_k: torch.Tensor,
                 block_table: torch.Tensor, scale: float, window_size: tuple[int, int] = (-1, -1),
                 softcap: float = 0.0, k_descale: float = 1.0, v_descale: float = 1.0,
                 out: torch.Tensor | None = None, return_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of ``q`` [B, H, D] (query b is the last token of sequence b) over a paged cache
    [num_blocks, block_size, Hk, D]; returns ``(out, lse)``, ``out`` written in place when given.
    Without ``return_lse`` (no cascade merge follows) and soft cap, torch's fused
    ``scaled_dot_product_attention`` computes it (half the time of the einsums; lse None)."""
    batch, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    group = num_heads // num_kv_heads
    kv_lens = seqused_k.to(torch.long)
    max_len = int(kv_lens.max()) if batch else 0
    if out is None:
        out = torch.empty(batch, num_heads, v_cache.shape[-1], dtype=q.dtype, device=q.device)
    if batch == 0 or max_len == 0:
        out.zero_()
        return out, torch.full((num_heads, batch), float("-inf"), device=q.device)
    # Pages past a sequence's length are masked below; clamped so that padding ids index safely.
    # index_select, not k_cache[pages]: the same gather, 3x faster on CPU.
    pages = block_table[:, : -(-max_len // block_size)].to(torch.long).clamp_(0, num_blocks - 1).flatten()
    k = k_cache.index_select(0, pages).view(batch, -1, num_kv_heads, head_dim)[:, :max_len].float()  # [B, L, Hk, D]
    v = v_cache.index_select(0, pages).view(batch, -1, num_kv_heads, v_cache.shape[-1])[:, :max_len].float()
    if k_descale != 1.0:
        k = k * k_descale
    if v_descale != 1.0:
        v = v * v_descale
    pos = torch.arange(max_len, device=q.device)[None, :]
    drop = pos >= kv_lens[:, None]  # [B, L]: keys past the sequence
    left, right = window_size
    if left >= 0:  # the query sits at kv_len - 1; right windows cannot clip a causal last query
        drop |= pos < (kv_lens[:, None] - 1 - left)
    if not return_lse and softcap <= 0 and bool((kv_lens > 0).all()):
        o = F.scaled_dot_product_attention(q.float()[:, :, None], k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=~drop[:, None, None, :], scale=scale, enable_gqa=True)
        out.copy_(o.view(batch, num_heads, -1).to(out.dtype))
        return out, None
    qg = q.float().view(batch, num_kv_heads, group, head_dim)
    s = torch.einsum("bkgd,blkd->bkgl", qg, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(drop[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [B, Hk, g]
    p = torch.exp(s - torch.where(lse.isinf(), 0.0, lse)[..., None])
    o = torch.einsum("bkgl,blkd->bkgd", p, v)
    out.copy_(o.reshape(batch, num_heads, -1).to(out.dtype))
    return out, lse.reshape(batch, num_heads).t().contiguous()
