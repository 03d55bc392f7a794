"""The logits processing steps of sampling, each one batched tensor op over the rows that use it
(vLLM's ``apply_penalties``, min-p, ``apply_top_k_top_p`` and ``apply_top_k_only``, and raw
logprobs), with no host-device sync: every size a kernel needs is known on the host.

A row's result depends only on its own logits and parameters, never on the rows it shares a
batch with, so a seeded draw stays a function of (seed, token index, logits).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - CPU machines without triton
    triton = None


def apply_penalties(logits: torch.Tensor, history: torch.Tensor, history_lens: torch.Tensor,
                    num_history: int, presence: torch.Tensor, frequency: torch.Tensor,
                    repetition: torch.Tensor) -> torch.Tensor:
    """vLLM's (and OpenAI's) penalties on ``logits`` [P, V] float32, out of place.

    ``history`` [num_history] is the rows' tokens concatenated (``history_lens`` [P] each), a
    prompt token as id + V, an output token as id.  Repetition (HF's): a logit of a token in the
    prompt or the output is divided by the penalty when positive, multiplied when not.  Then
    frequency x (its count in the output) and presence x (whether it is in the output) are
    subtracted.  Penalties are [P, 1]."""
    P, V = logits.shape
    row = torch.repeat_interleave(torch.arange(P, device=logits.device), history_lens.long(),
                                  output_size=num_history)  # output_size: no sync for the size
    counts = torch.zeros(P, 2 * V, dtype=torch.float32, device=logits.device)
    counts.view(-1).index_add_(0, row * (2 * V) + history.long(),
                               torch.ones(num_history, dtype=torch.float32, device=logits.device))
    output_counts = counts[:, :V]
    output_mask = output_counts > 0
    seen = output_mask | (counts[:, V:] > 0)
    penalties = torch.where(seen, repetition, 1.0)
    logits = logits * torch.where(logits > 0, 1.0 / penalties, penalties)
    return logits - frequency * output_counts - presence * output_mask


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than ``min_p`` [R, 1] times the row's most likely one."""
    probs = logits.softmax(dim=-1)
    keep_from = min_p * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < keep_from, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """vLLM's sort-based filter: keep the tokens at least as likely as the k-th (``k`` [R] long,
    V = off), then the fewest most likely ones whose mass reaches ``p`` [R] (1 = off).  Ties
    with the k-th token are kept, as in vLLM."""
    V = logits.shape[1]
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    kth = logits_sort.gather(1, (V - k.clamp(1, V))[:, None])
    logits_sort.masked_fill_(logits_sort < kth, float("-inf"))
    probs_sum = logits_sort.softmax(dim=-1).cumsum_(dim=-1)
    top_p_mask = probs_sum <= 1 - p[:, None]
    top_p_mask[:, -1] = False  # the most likely token always stays
    logits_sort.masked_fill_(top_p_mask, float("-inf"))
    return torch.empty_like(logits).scatter_(1, logits_idx, logits_sort)


def apply_top_k_only(logits: torch.Tensor, k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """The top-k filter without a full sort (vLLM's ``apply_top_k_only``): one ``topk`` of the
    batch's largest k, known on the host (a device ``k.max()`` would sync)."""
    V = logits.shape[1]
    kth = logits.topk(min(max_top_k, V), dim=-1).values.gather(1, (k.clamp(1, V) - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def gumbel_argmax(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """A draw from softmax(logits) given uniforms ``u``: argmax(logits + Gumbel noise).  A token
    filtered to -inf is never drawn."""
    return (logits - torch.log(-torch.log(u))).argmax(dim=-1)


def compute_logprobs(raw_logits: torch.Tensor, tokens: torch.Tensor,
                     num_logprobs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's ``gather_logprobs`` on log_softmax(raw logits) [L, V]: ids int32 [L, 1 + n] and
    logprobs float32 [L, 1 + n] (column 0 the sampled ``tokens`` [L], then the top n), and the
    sampled token's rank int32 [L] (1 + the tokens more likely; ties count as more likely)."""
    logprobs = torch.log_softmax(raw_logits.float(), dim=-1)
    tok = tokens.long()[:, None]
    tok_lp = logprobs.gather(1, tok)
    ranks = (logprobs >= tok_lp).sum(dim=-1).to(torch.int32)
    ids, lps = tok, tok_lp
    if num_logprobs:
        top_lp, top_ids = logprobs.topk(num_logprobs, dim=-1)
        ids, lps = torch.cat([tok, top_ids], dim=1), torch.cat([tok_lp, top_lp], dim=1)
    return ids.to(torch.int32), lps, ranks


def apply_token_bitmask_inplace(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """-inf, in place, at the disallowed ids of ``logits[rows]`` (``logits`` [B, V] float32,
    ``rows`` [G] long, ``bitmask`` int32 [G, >= ceil(V/32)]).  On a GPU one Triton kernel reads
    each word once per 32 ids and writes only the disallowed logits: no [G, V] temporary, no
    gather and scatter of the rows.  Elsewhere the torch unpacking below."""
    G, V = len(rows), logits.shape[1]
    if G == 0:
        return
    if bitmask.shape[0] != G or bitmask.shape[1] * 32 < V:
        raise ValueError(f"grammar_bitmask is {tuple(bitmask.shape)}, want [{G}, >= {(V + 31) // 32}] "
                         f"for {G} rows of {V} logits")
    if _triton_ok(logits, bitmask):
        grid = (G, triton.cdiv(V, _BLOCK))
        _bitmask_kernel[grid](logits, rows, bitmask, V, logits.stride(0), bitmask.stride(0), BLOCK=_BLOCK)
        return
    logits[rows] = apply_token_bitmask(logits[rows], bitmask)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` [G, V] with every id whose bit is clear in ``bitmask`` (int32 [G, ceil(V/32)],
    bit ``id % 32`` of word ``id // 32``: xgrammar's layout) set to -inf.  Plain tensor ops, so
    the same code runs on CPU and on a GPU, over just the constrained rows."""
    G, V = logits.shape
    # Unpacked a byte at a time through a [256, 8] table: one bool per id, where shifting whole
    # words would materialise an int32 per id (4x the memory traffic over [G, V]).  Bytes are
    # the words' little-endian bytes, so byte j of word w holds ids 32w + 8j .. 32w + 8j + 7.
    table = _bit_table(bitmask.device)
    disallowed = table[bitmask.contiguous().view(torch.uint8).long()].reshape(G, -1)[:, :V]
    return logits.masked_fill(disallowed, float("-inf"))


_TABLES: dict = {}


def _bit_table(device) -> torch.Tensor:
    """bool [256, 8]: bit k of byte b is clear (the id is disallowed)."""
    t = _TABLES.get(device)
    if t is None:
        b = torch.arange(256, dtype=torch.int32)
        t = _TABLES[device] = (((b[:, None] >> torch.arange(8, dtype=torch.int32)) & 1) == 0).to(device)
    return t


# Ids per program: 4096 ids read 128 words (512 bytes) of one row's mask and write at most 16 KiB
# of logits, so a 128k vocabulary is 32 programs a row.
_BLOCK = 4096


def _triton_ok(logits: torch.Tensor, bitmask: torch.Tensor) -> bool:
    return (triton is not None and logits.is_cuda and logits.dtype == torch.float32
            and logits.stride(1) == 1 and bitmask.is_cuda and bitmask.dtype == torch.int32
            and bitmask.stride(1) == 1)


if triton is not None:

    @triton.jit
    def _bitmask_kernel(logits_ptr, rows_ptr, mask_ptr, V, logits_stride, mask_stride, BLOCK: tl.constexpr):
        g = tl.program_id(0)
        ids = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = ids < V
        row = tl.load(rows_ptr + g).to(tl.int64)
        # 32 lanes read each word; they share one cache line, so the mask is read once
        words = tl.load(mask_ptr + g.to(tl.int64) * mask_stride + ids // 32, mask=inside, other=-1)
        clear = ((words >> (ids % 32)) & 1) == 0  # an arithmetic shift keeps bit 0 right for bit 31
        tl.store(logits_ptr + row * logits_stride + ids, tl.full([BLOCK], float("-inf"), tl.float32),
                 mask=inside & clear)
