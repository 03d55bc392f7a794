"""Decode-shaped paged attention for the torch kernel, batched: one gather of every sequence's
pages and two einsums for the whole batch, instead of ``reference.paged_attention_ref``'s Python
loop of ~10 small ops per sequence.

On CPU the loop cost more than the model's matmuls: SmolLM2-135M at batch 8 and ~300 tokens of
context spent 38 of 60 s in it (scripts/bench_cpu_vs_hf.py; per-op overhead, not arithmetic).
It serves plain decode steps (one query a sequence) and the steps that verify speculative drafts
(a causal query of 1 + k tokens, k <= ``MAX_QUERY - 1``, at the end of each sequence): on the
loop, a step verifying one draft cost SmolLM2 7.5 ms more than a plain one, a third of the step.
Same conventions and results as the reference (float32 math; the LSE ``[heads, tokens]``,
natural log); the reference stays the oracle and runs everything this does not take
(``supports``): prefill and mixed steps, ALiBi, fp8 caches, float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# The longest query a sequence may bring (1 + the drafts it verifies); longer ones are prefill
# chunks, whose [Q, L] score blocks the reference computes a sequence at a time.
MAX_QUERY = 16


def supports(q: torch.Tensor, k_cache: torch.Tensor, cu_seqlens_q: torch.Tensor, max_seqlen_q: int,
             alibi_slopes, compute_dtype: torch.dtype, causal: bool = True) -> bool:
    """Queries of at most ``MAX_QUERY`` tokens per sequence (causal when longer than one: decode
    or verification), no ALiBi, a float16/bfloat16/float32 cache."""
    if max_seqlen_q == 1:
        ok = q.shape[0] == cu_seqlens_q.shape[0] - 1
    else:
        ok = causal and 1 < max_seqlen_q <= MAX_QUERY
    return ok and alibi_slopes is None and compute_dtype == torch.float32 and k_cache.dtype.itemsize > 1


@dataclass
class StepPlan:
    """What ``paged_decode`` derives from a step's metadata alone: the same for every layer of
    the step, so it is built once (``step_plan``) -- on CPU its ~15 small ops a layer were a
    tenth of a SmolLM2 decode step at batch 1."""
    batch: int
    max_len: int
    kv_lens: torch.Tensor  # [B] long
    q_lens: torch.Tensor  # [B] long
    Q: int  # the query grid's width
    seq: torch.Tensor | None  # Q > 1: each query's sequence, and its column in the grid
    col: torch.Tensor | None
    pages: torch.Tensor  # [B * pages] long: every sequence's pages, clamped to valid ids
    drop: torch.Tensor  # [B, Q, L] bool: the keys each query must not see
    sdpa_mask: torch.Tensor | None  # ~drop for SDPA; None where it drops nothing
    all_nonempty: bool


def step_plan(tokens: int, seqused_k: torch.Tensor, block_table: torch.Tensor, cu_seqlens_q: torch.Tensor | None,
              window_size: tuple[int, int], num_blocks: int, block_size: int, plans: dict | None = None) -> StepPlan:
    """The plan for these arguments; ``plans``: the step's own cache (a dict kept on the step's
    metadata, which every layer shares: ``TorchKernel.scheduler_metadata``), None to build it."""
    if plans is None:
        return _build_plan(tokens, seqused_k, block_table, cu_seqlens_q, window_size, num_blocks, block_size)
    key = (tokens, cu_seqlens_q is None, tuple(window_size), num_blocks, block_size)
    plan = plans.get(key)
    if plan is None:
        plan = plans[key] = _build_plan(tokens, seqused_k, block_table, cu_seqlens_q, window_size, num_blocks,
                                        block_size)
    return plan


def _build_plan(tokens, seqused_k, block_table, cu_seqlens_q, window_size, num_blocks, block_size) -> StepPlan:
    device = seqused_k.device
    batch = seqused_k.shape[0]
    kv_lens = seqused_k.to(torch.long)
    max_len = int(kv_lens.max()) if batch else 0
    seq = col = None
    if cu_seqlens_q is None:  # one query a sequence: no padding
        q_lens = torch.ones(batch, dtype=torch.long, device=device)
        Q = 1
    else:  # sequence b's queries into rows [b, :q_len[b]] of a [B, Q] grid
        q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(torch.long)
        Q = int(q_lens.max()) if batch else 1  # the grid's width from the queries, not the caller's bound
        seq = torch.repeat_interleave(torch.arange(batch, device=device), q_lens)
        col = torch.arange(tokens, device=device) - cu_seqlens_q.to(torch.long)[seq]
    # Pages past a sequence's length are masked below; clamped so that padding ids index safely.
    pages = block_table[:, : -(-max_len // block_size)].to(torch.long).clamp_(0, num_blocks - 1).flatten()
    # Each query's position: the sequence's last q_len tokens; padding rows sit at the last one
    # (they see keys, so no row is all -inf, and are dropped at the end).
    j = torch.arange(Q, device=device)[None, :]
    q_pos = torch.where(j < q_lens[:, None], kv_lens[:, None] - q_lens[:, None] + j, kv_lens[:, None] - 1)  # [B, Q]
    pos = torch.arange(max_len, device=device)[None, None, :]
    drop = pos > q_pos[..., None]  # [B, Q, L]: causal, and keys past the sequence
    left, right = window_size
    if left >= 0:
        drop |= pos < (q_pos[..., None] - left)
    if right >= 0:
        drop |= pos > (q_pos[..., None] + right)
    # One query a sequence, every sequence max_len long, no window: nothing to drop, and SDPA
    # runs unmasked (batch 1 decode always).
    unmasked = Q == 1 and left < 0 and right < 0 and bool((kv_lens == max_len).all())
    return StepPlan(batch, max_len, kv_lens, q_lens, Q, seq, col, pages, drop,
                    None if unmasked else ~drop[:, None], bool((kv_lens > 0).all()))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, seqused_k: torch.Tensor,
                 block_table: torch.Tensor, scale: float, window_size: tuple[int, int] = (-1, -1),
                 softcap: float = 0.0, k_descale: float = 1.0, v_descale: float = 1.0,
                 out: torch.Tensor | None = None, return_lse: bool = True, cu_seqlens_q: torch.Tensor | None = None,
                 max_seqlen_q: int = 1, plans: dict | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of ``q`` [T, H, D] over a paged cache [num_blocks, block_size, Hk, D]; returns
    ``(out, lse)``, ``out`` written in place when given.  Without ``cu_seqlens_q`` query b is the
    last token of sequence b; with it, sequence b's queries ``cu[b]:cu[b+1]`` are its last tokens,
    causal among themselves.  Without ``return_lse`` (no cascade merge follows) and soft cap,
    torch's fused ``scaled_dot_product_attention`` computes it (half the time of the einsums;
    lse None).  ``plans``: the step's cache of ``StepPlan`` (see ``step_plan``)."""
    tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty(tokens, num_heads, v_cache.shape[-1], dtype=q.dtype, device=q.device)
    plan = step_plan(tokens, seqused_k, block_table, cu_seqlens_q if max_seqlen_q > 1 else None,
                     window_size, num_blocks, block_size, plans)
    batch, max_len, Q, seq, col, drop = plan.batch, plan.max_len, plan.Q, plan.seq, plan.col, plan.drop
    if tokens == 0 or max_len == 0:
        out.zero_()
        return out, torch.full((num_heads, tokens), float("-inf"), device=q.device)
    if Q == 1:
        qp = q.float().view(batch, 1, num_heads, head_dim)
    else:
        qp = q.new_zeros(batch, Q, num_heads, head_dim, dtype=torch.float32)
        qp[seq, col] = q.float()
    # index_select, not k_cache[pages]: the same gather, 3x faster on CPU.
    k = k_cache.index_select(0, plan.pages).view(batch, -1, num_kv_heads, head_dim)[:, :max_len].float()  # [B, L, Hk, D]
    v = v_cache.index_select(0, plan.pages).view(batch, -1, num_kv_heads, v_cache.shape[-1])[:, :max_len].float()
    if k_descale != 1.0:
        k = k * k_descale
    if v_descale != 1.0:
        v = v * v_descale
    if not return_lse and softcap <= 0 and plan.all_nonempty:
        o = F.scaled_dot_product_attention(qp.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=plan.sdpa_mask, scale=scale, enable_gqa=True)  # [B, H, Q, D]
        o, lse = o.transpose(1, 2), None
    else:
        qg = qp.view(batch, Q, num_kv_heads, group, head_dim)
        s = torch.einsum("bqkgd,blkd->bkgql", qg, k) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(drop[:, None, None], float("-inf"))
        lse = torch.logsumexp(s, dim=-1)  # [B, Hk, g, Q]
        p = torch.exp(s - torch.where(lse.isinf(), 0.0, lse)[..., None])
        o = torch.einsum("bkgql,blkd->bqkgd", p, v).reshape(batch, Q, num_heads, -1)
        lse = lse.reshape(batch, num_heads, Q).transpose(1, 2)  # [B, Q, H]
    if Q == 1:
        out.copy_(o.reshape(batch, num_heads, -1).to(out.dtype))
        return out, None if lse is None else lse.reshape(batch, num_heads).t().contiguous()
    out.copy_(o[seq, col].to(out.dtype))
    return out, None if lse is None else lse[seq, col].t().contiguous()
