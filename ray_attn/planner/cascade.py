"""Cascade attention decisions: vLLM's heuristic, prefix-group detection, the multi-group model,
and the measured break-even (``cascade_threshold``) that the engine hands the planner.

Cascade attention splits a batch's attention into one non-causal pass over a shared prefix (read
once per group of requests instead of once per request), one causal pass over each request's own
suffix, and a merge of the two by their log-sum-exp.  With one group this is vLLM v1's cascade.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ray_attn.config import EngineConfig

# vLLM's thresholds (flash_attn.py, ``use_cascade_attention``): arbitrary but shared, so that a
# single-group batch is decided exactly as vLLM decides it.
MIN_COMMON_PREFIX_LEN = 256
MIN_NUM_REQS = 8
Q_TILE_SIZE = 128
KV_TILE_SIZE = 128


def cdiv(a, b):
    return -(a // -b)


def _vllm_gates(prefix_len: int, what: str, use_alibi: bool, use_sliding_window: bool,
                num_reqs: int) -> str | None:
    """vLLM's refusals before its cost model, in its order; the reason, or None to go on."""
    if prefix_len < MIN_COMMON_PREFIX_LEN:
        return f"{what} {prefix_len} < {MIN_COMMON_PREFIX_LEN} tokens"
    if use_alibi:
        return "ALiBi is not supported by cascade attention"
    if use_sliding_window:
        return "sliding window is not supported by cascade attention"
    if num_reqs < MIN_NUM_REQS:
        return f"{num_reqs} requests < {MIN_NUM_REQS}"
    return None


def cascade_verdict(
    common_prefix_len: int,
    query_lens: np.ndarray,
    num_query_heads: int,
    num_kv_heads: int,
    use_alibi: bool,
    use_sliding_window: bool,
    num_sms: int,
) -> tuple[bool, str]:
    """vLLM v1's ``use_cascade_attention`` rules, in its order, plus the reason for the verdict."""
    why = _vllm_gates(common_prefix_len, "common prefix", use_alibi, use_sliding_window, len(query_lens))
    if why:
        return False, why
    num_reqs = len(query_lens)
    num_queries_per_kv = num_query_heads // num_kv_heads
    # FlashDecoding (split-KV) is what plain attention would use; without it, cascade saves memory
    # bandwidth and wins.
    use_flash_decoding = (
        num_queries_per_kv > 1
        and not use_sliding_window
        and not use_alibi
        and bool(np.all(np.asarray(query_lens) == 1))
    )
    if not use_flash_decoding:
        return True, f"cascade: prefix {common_prefix_len} tokens, no flash-decoding to compete with"
    num_prefix_tiles = cdiv(common_prefix_len, KV_TILE_SIZE)
    cascade_ctas = num_query_heads * cdiv(num_reqs, Q_TILE_SIZE)
    cascade_time = cdiv(cascade_ctas, num_sms) * num_prefix_tiles
    fd_ctas = num_reqs * num_kv_heads * cdiv(num_queries_per_kv, Q_TILE_SIZE) * num_prefix_tiles
    fd_time = cdiv(fd_ctas, num_sms)
    if cascade_time < fd_time:
        return True, f"cascade: cost {cascade_time} < flash-decoding {fd_time}"
    return False, f"flash-decoding cost {fd_time} <= cascade {cascade_time}"


def use_cascade_attention(
    common_prefix_len: int,
    query_lens: np.ndarray,
    num_query_heads: int,
    num_kv_heads: int,
    use_alibi: bool,
    use_sliding_window: bool,
    num_sms: int,
) -> bool:
    """Decide whether to use cascade attention (vLLM v1's signature and rules)."""
    return cascade_verdict(
        common_prefix_len, query_lens, num_query_heads, num_kv_heads, use_alibi,
        use_sliding_window, num_sms,
    )[0]


def multi_group_cascade_verdict(
    prefix_lens: np.ndarray,
    group_num_reqs: np.ndarray,
    group_num_tokens: np.ndarray,
    query_lens: np.ndarray,
    num_query_heads: int,
    num_kv_heads: int,
    use_alibi: bool,
    use_sliding_window: bool,
    num_sms: int,
) -> tuple[bool, str]:
    """vLLM's heuristic extended to G prefix groups; with G == 1 it is exactly ``cascade_verdict``.

    Cost model (units: one 128-key tile processed by one CTA, as in vLLM's):

    * cascade prefix pass: group g launches ``num_query_heads * cdiv(T_g, 128)`` CTAs (T_g = the
      group's query tokens), each sweeping ``cdiv(P_g, 128)`` prefix tiles.  CTAs are scheduled
      longest first in waves of ``num_sms``; a wave lasts as long as its longest CTA, and the time is
      the sum over waves.  With one group every CTA has the same length and this is vLLM's
      ``cdiv(ctas, num_sms) * num_prefix_tiles``.
    * flash-decoding: every request splits its prefix into tiles, one CTA per (kv head, tile):
      ``cdiv(sum_g n_g * num_kv_heads * cdiv(q_per_kv, 128) * cdiv(P_g, 128), num_sms)``.
    Both ignore the suffix pass, which the two methods share.  The gates before the model are
    vLLM's, applied to the longest group prefix, plus one of our own: some group must hold two or
    more requests (otherwise nothing is shared and cascade only adds a merge).
    """
    prefix_lens = np.asarray(prefix_lens, dtype=np.int64)
    group_num_reqs = np.asarray(group_num_reqs, dtype=np.int64)
    if len(prefix_lens) == 1:
        return cascade_verdict(
            int(prefix_lens[0]), query_lens, num_query_heads, num_kv_heads, use_alibi,
            use_sliding_window, num_sms,
        )
    longest = int(prefix_lens.max())
    why = _vllm_gates(longest, "longest group prefix", use_alibi, use_sliding_window, len(query_lens))
    if why:
        return False, why
    if int(group_num_reqs.max()) < 2:
        return False, "no two requests share a prefix block"
    G = len(prefix_lens)
    num_queries_per_kv = num_query_heads // num_kv_heads
    use_flash_decoding = num_queries_per_kv > 1 and bool(np.all(np.asarray(query_lens) == 1))
    if not use_flash_decoding:
        return True, f"cascade: {G} groups, longest prefix {longest} tokens, no flash-decoding"
    tiles = cdiv(prefix_lens, KV_TILE_SIZE)
    ctas = num_query_heads * cdiv(np.asarray(group_num_tokens, dtype=np.int64), Q_TILE_SIZE)
    order = np.argsort(-tiles, kind="stable")
    cum = np.cumsum(ctas[order])
    wave_heads = np.arange(0, int(cum[-1]), num_sms)  # first (= longest) CTA of each wave
    cascade_time = int(tiles[order][np.searchsorted(cum, wave_heads, side="right")].sum())
    fd_ctas = int((group_num_reqs * tiles).sum()) * num_kv_heads * cdiv(num_queries_per_kv, Q_TILE_SIZE)
    fd_time = cdiv(fd_ctas, num_sms)
    if cascade_time < fd_time:
        return True, f"cascade: {G} groups, cost {cascade_time} < flash-decoding {fd_time}"
    return False, f"{G} groups: flash-decoding cost {fd_time} <= cascade {cascade_time}"


def measured_cascade_verdict(prefix_lens: np.ndarray, group_num_reqs: np.ndarray,
                             min_saved_kv_tokens: int) -> tuple[bool, str]:
    """Cascade when it saves reading at least ``min_saved_kv_tokens`` KV tokens per layer.

    Why a byte count and not vLLM's CTA-wave model: on the H200 with FlashAttention 3
    (scripts/bench_cascade.py, benchmarks/NOTES.md) a cascade layer costs a near-constant ~0.3 ms
    (two kernel passes, the merge, and their launches) while plain decode costs the KV bytes it
    reads.  Cascade reads each group's prefix once instead of once per request, so it saves
    ``sum_g (n_g - 1) * P_g`` tokens; it wins exactly when reading those takes longer than its
    fixed cost.  vLLM's model picked the slower path in 31% of that grid; this rule in 2%.
    """
    saved = int(((np.asarray(group_num_reqs, np.int64) - 1) * np.asarray(prefix_lens, np.int64)).sum())
    if saved >= min_saved_kv_tokens:
        return True, f"cascade: saves {saved} KV tokens per layer >= {min_saved_kv_tokens}"
    return False, f"saves {saved} KV tokens per layer < {min_saved_kv_tokens}: plain is faster"


# --------------------------------------------------------------------------------- group detection
def _lcp(block_table: np.ndarray, cap: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Leading blocks each row shares with row ``ref[row]``, counting only the first ``cap`` blocks
    of either (blocks not computed before the step cannot be a cascade prefix)."""
    m = np.minimum(cap, cap[ref])
    width = int(m.max()) if m.size else 0
    if width == 0:
        return np.zeros(len(cap), dtype=np.int64)
    neq = block_table[:, :width] != block_table[ref, :width]
    first = neq.argmax(axis=1)  # first mismatch, or 0 when there is none
    first[~neq[np.arange(len(first)), first]] = width
    return np.minimum(first, m)


def common_prefix_blocks(block_table: np.ndarray, cap: np.ndarray) -> int:
    """vLLM's single group: the leading blocks shared by every row (capped by ``cap``)."""
    k = int(cap.min()) if cap.size else 0
    if k == 0:
        return 0
    same = (block_table[:, :k] == block_table[:1, :k]).all(axis=0)
    return int(k if same.all() else same.argmin())


def _partition(keys: list[np.ndarray], block_table, cap):
    """Group rows by equal ``keys`` (a lexsort, no Python loop).  Returns labels (groups numbered in
    key order), each group's prefix in blocks, and its size."""
    order = np.lexsort(keys[::-1])
    B = len(order)
    change = np.zeros(B, dtype=bool)
    change[0] = True
    for k in keys:
        ks = k[order]
        change[1:] |= ks[1:] != ks[:-1]
    starts = np.flatnonzero(change)
    labels = np.empty(B, dtype=np.int64)
    labels[order] = np.cumsum(change) - 1
    ref = order[starts][labels]  # each row's group reference: the group's first row in key order
    prefix = np.minimum.reduceat(_lcp(block_table, cap, ref)[order], starts)
    sizes = np.diff(np.append(starts, B))
    return labels, prefix, sizes


def find_prefix_groups(block_table: np.ndarray, cap: np.ndarray, max_rounds: int = 8):
    """Split the batch into groups of requests that share leading blocks.

    Shared blocks come from the hash-chained prefix cache (hits and the planner's deduplication),
    so sharing forms a trie over the block table rows.  A prefix is compared column by column from
    column 0, so sharing that does not start there is ignored, never mis-grouped.  Start from the
    coarsest groups (equal first block), then refine: a group whose
    prefix is P blocks is split by each row's block at column P (the next trie level) when the split
    shares more, measured as blocks not re-read, ``sum_g (n_g - 1) * P_g``.  One round is a lexsort
    and a compare over the block table; rounds stop when no group gains (usually one or two).

    Returns ``(labels [B], prefix_blocks [G], ref_rows [G])`` with groups numbered in order of first
    appearance in the batch and ``ref_rows[g]`` a row of group g (its first in batch order).
    """
    B = block_table.shape[0]
    rows = np.arange(B)
    unique_tail = -1 - rows  # a key no other row has
    key0 = np.where(cap > 0, block_table[:, 0], unique_tail)
    labels, prefix, sizes = _partition([key0], block_table, cap)
    for _ in range(max_rounds):
        p = prefix[labels]
        ends = cap <= p
        nxt = np.where(ends, unique_tail, block_table[rows, np.minimum(p, block_table.shape[1] - 1)])
        clabels, cprefix, csizes = _partition([labels, nxt], block_table, cap)
        # children keep their parent's order, so the parent of child c is the label of any member
        parent_of_child = np.empty(len(cprefix), dtype=np.int64)
        parent_of_child[clabels] = labels
        gain = np.bincount(parent_of_child, weights=(csizes - 1) * cprefix, minlength=len(prefix))
        split = gain > (sizes - 1) * prefix
        if not split.any():
            break
        merged = np.where(split[labels], clabels + len(prefix), labels)
        _, labels = np.unique(merged, return_inverse=True)
        labels = labels.reshape(-1)
        # recompute prefixes and sizes of the new partition
        labels, prefix, sizes = _partition([labels], block_table, cap)
    # renumber groups by first appearance in the batch
    first = np.full(len(prefix), B, dtype=np.int64)
    np.minimum.at(first, labels, rows)
    order = np.argsort(first, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return rank[labels], prefix[order], first[order]


# --------------------------------------------------------------------------------- the step's choice
@dataclass(frozen=True)
class CascadeConfig:
    block_size: int
    num_query_heads: int
    num_kv_heads: int
    use_alibi: bool
    sliding_window: int | None
    attention_chunk_size: int | None
    num_sms: int
    enable: bool = True
    multi_group: bool = True
    min_saved_kv_tokens: int | None = None  # set: the measured policy replaces vLLM's cost model


@dataclass
class CascadeChoice:
    use: bool
    reason: str
    labels: np.ndarray | None = None  # [B] group of each request (input order)
    prefix_blocks: np.ndarray | None = None  # [G] shared leading blocks of each group
    ref_rows: np.ndarray | None = None  # [G] a request of each group (input order)
    # True when the verdict came from the group search: for the same batch in a later decode step
    # it still holds (shared blocks never change while no request joins or leaves), so the builder
    # may reuse it after re-checking the rules that depend on sequence lengths.
    reusable: bool = False


def cascade_refusal(cfg: CascadeConfig, num_reqs: int, max_seq: int) -> str | None:
    """The rules that do not depend on the block table (cheap, checked every step)."""
    if not cfg.enable:
        return "cascade disabled"
    if num_reqs < MIN_NUM_REQS:
        return f"{num_reqs} requests < {MIN_NUM_REQS}"
    if cfg.use_alibi:
        return "ALiBi is not supported by cascade attention"
    w = cfg.sliding_window
    if w is not None and max_seq > w:
        # valid only when no query's window clips the prefix: p - (w - 1) <= 0 for every p
        return f"sliding window {w} clips: a query sits at position {max_seq - 1} >= {w}"
    C = cfg.attention_chunk_size
    if C is not None and max_seq > C:
        return f"local attention: keys span several chunks (max seq_len {max_seq} > chunk {C})"
    return None


def decide_cascade(cfg: CascadeConfig, bt, computed, q, max_seq: int, maybe_shared: bool = True,
                   reuse: CascadeChoice | None = None) -> CascadeChoice:
    """Whether and how this step cascades.  ``bt`` is the batch's block table, ``computed`` the
    tokens each request had in cache before the step, ``q`` its new tokens.  ``maybe_shared=False``
    (no block in the pool has two holders) skips the group search; ``reuse`` is the previous
    step's verdict for the same batch.  Cheap refusals come first; every rule is a conjunct, so the
    order changes the reason, never the verdict."""
    B = len(q)
    why = cascade_refusal(cfg, B, max_seq)
    if why is not None:
        return CascadeChoice(False, why)
    if reuse is not None:
        return reuse
    if not maybe_shared:
        return CascadeChoice(False, "no two requests share a prefix block")
    bs = cfg.block_size
    # whole blocks before each row's first query -- in the cache before the step, or a hit on
    # blocks another row writes in it, which every layer does before it attends: the prefix may
    # only use these
    cap = computed // bs
    if int(cap.max()) * bs < MIN_COMMON_PREFIX_LEN:
        return CascadeChoice(False, f"every computed prefix is < {MIN_COMMON_PREFIX_LEN} tokens")
    # Past the window / chunk checks the layer behaves as full causal attention (no window clips,
    # one chunk holds every key), so the heuristic sees no sliding window.
    heads = (cfg.num_query_heads, cfg.num_kv_heads, False, False, cfg.num_sms)
    if not cfg.multi_group:
        P = common_prefix_blocks(bt, cap)
        if cfg.min_saved_kv_tokens is not None and P * bs >= MIN_COMMON_PREFIX_LEN:
            ok, why = measured_cascade_verdict(np.array([P * bs]), np.array([B]), cfg.min_saved_kv_tokens)
        else:
            ok, why = cascade_verdict(P * bs, q, *heads)
        if not ok:
            return CascadeChoice(False, why, reusable=True)
        return CascadeChoice(True, why, np.zeros(B, dtype=np.int64), np.array([P]), np.array([0]), True)
    if int(cap.min()) == 0:
        i = int(cap.argmin())
        return CascadeChoice(False, f"request at batch index {i} has no fully computed block to share")
    first = np.sort(bt[:, 0])
    if not (first[1:] == first[:-1]).any():
        return CascadeChoice(False, "no two requests share a prefix block")
    labels, prefix, refs = find_prefix_groups(bt, cap)
    sizes = np.bincount(labels)
    tokens = np.bincount(labels, weights=q).astype(np.int64)
    if cfg.min_saved_kv_tokens is not None:
        ok, why = measured_cascade_verdict(prefix * bs, sizes, cfg.min_saved_kv_tokens)
    else:
        ok, why = multi_group_cascade_verdict(prefix * bs, sizes, tokens, q, *heads)
    if not ok:
        return CascadeChoice(False, why, reusable=True)
    return CascadeChoice(True, why, labels, prefix, refs, True)


def fill_cascade_metadata(attn, bt, nblocks, seq, q, labels, prefix_blocks, ref_rows, block_size,
                          prefix_part=None):
    """Write the cascade fields of ``attn``.  Rows are in batch order with each group contiguous.

    Returns the step-independent part (prefix tables, query counts per group, each row's shift),
    which a later decode step of the same batch passes back as ``prefix_part`` (fresh copies go
    into the plan)."""
    bs = block_size
    if prefix_part is None:
        G = len(prefix_blocks)
        P = np.asarray(prefix_blocks, dtype=np.int64)
        maxp = int(P.max())
        cu = np.zeros(G + 1, dtype=np.int32)
        cu[1:] = np.cumsum(np.bincount(labels, weights=q, minlength=G))
        table = np.where(np.arange(maxp) < P[:, None], bt[ref_rows][:, :maxp], 0).astype(np.int32)
        prefix_part = (cu, (P * bs).astype(np.int32), table, P[labels], maxp * bs)
    cu, kv_lens, table, shift, common = prefix_part
    attn.use_cascade = True
    attn.common_prefix_len = common
    attn.cu_prefix_query_lens = cu.copy()
    attn.prefix_kv_lens = kv_lens.copy()
    attn.prefix_block_table = table.copy()
    attn.suffix_kv_lens = (seq - shift * bs).astype(np.int32)
    # each row shifted left by its group's prefix, gathered in one fancy index from a view that
    # holds every shifted window of the table (zero-padded on the right; entries past a row's
    # blocks are already 0): window [i, s] = row i from column s on
    B, W = bt.shape
    width = max(int((nblocks - shift).max()), 1)
    padded = np.zeros((B, W + width), dtype=np.int32)
    padded[:, :W] = bt
    st = padded.strides
    windows = np.lib.stride_tricks.as_strided(padded, (B, W + 1, width), (st[0], st[1], st[1]),
                                              writeable=False)
    attn.suffix_block_table = windows[np.arange(B), shift]
    attn.max_suffix_kv_len = int(attn.suffix_kv_lens.max())
    return prefix_part


# On the H200 a FlashAttention cascade layer launched eagerly costs about what reading 1 GiB of
# KV costs; replayed from a CUDA graph (decode steps) its launches are free and the break-even
# falls to ~100 MiB (scripts/bench_cascade.py, benchmarks/NOTES.md).  Below it, plain wins.
CASCADE_BREAK_EVEN_BYTES = 1 << 30
CASCADE_BREAK_EVEN_BYTES_GRAPHED = 96 << 20


def cascade_threshold(config: EngineConfig, kernel: str, graphs: bool | None = None) -> int | None:
    """KV tokens a cascade must save per layer on this rank, for the measured policy on GPU
    kernels; None (vLLM's cost model) for the torch kernel, where no measurement applies."""
    if kernel not in ("fa3", "fa2"):
        return None
    m, tp = config.model, config.parallel.tensor_parallel_size
    kv_heads = max(m.num_key_value_heads // tp, 1)
    elem = 1 if config.cache.kv_cache_dtype != "auto" else (4 if m.dtype == "float32" else 2)
    if graphs is None:
        # Imported here: the planner stays importable without the runtime package (torch, ray).
        from ray_attn.runtime.cuda_graphs import wants_cuda_graphs

        graphs = wants_cuda_graphs(config.parallel, kernel)
    budget = CASCADE_BREAK_EVEN_BYTES_GRAPHED if graphs else CASCADE_BREAK_EVEN_BYTES
    return budget // (2 * kv_heads * m.head_size * elem)
