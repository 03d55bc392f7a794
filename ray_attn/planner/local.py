"""Chunked local attention (Llama 4 iRoPE layers) as virtual batches.

A query at position p attends only the keys of its own chunk, ``[p // C * C, p]``.  Splitting every
request at chunk boundaries turns that into plain causal paged attention over "virtual" requests,
one per (request, chunk touched by this step's queries).  Same meaning and return values as vLLM
v1's (numpy) ``make_local_attention_virtual_batches``.
"""

from __future__ import annotations

import numpy as np

from .errors import PlannerConfigError


def make_local_attention_virtual_batches(
    attn_chunk_size: int,
    query_start_loc_np: np.ndarray,
    seq_lens_np: np.ndarray,
    block_table: np.ndarray,
    block_size: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Split each request's queries at local-attention chunk boundaries.

    Example (vLLM's): chunk 4, q_seqlens [4, 10, 5], k_seqlens [6, 17, 9], block size 2 gives
    seqlens_q_local [2, 2, 1, 4, 4, 1, 4, 1], cu_seqlens_q_local [0, 2, 4, 5, 9, 13, 14, 18, 19],
    seqlens_k_local [4, 2, 4, 4, 4, 1, 4, 1], and ``block_table_local[v]`` = the
    ``attn_chunk_size // block_size`` pages of virtual batch v's chunk (request 1's chunks start at
    k[4], k[8], k[12], k[16], so its rows are pages [2, 3], [4, 5], [6, 7], [8, 9] of its row).

    Returns ``(seqlens_q_local, cu_seqlens_q_local, seqlens_k_local, block_table_local)``, all int32.
    Pages past the end of the table repeat its last column, as vLLM's clip does; the kernel never
    reads them because ``seqlens_k_local`` stops before.
    """
    C = int(attn_chunk_size)
    if C <= 0 or block_size <= 0 or C % block_size:
        raise PlannerConfigError(
            f"attn_chunk_size {attn_chunk_size} must be a positive multiple of block_size {block_size}"
        )
    qsl = np.asarray(query_start_loc_np)
    seq = np.asarray(seq_lens_np)
    q = qsl[1:] - qsl[:-1]
    B = len(seq)
    pages = C // block_size
    bt = np.asarray(block_table)
    if B == 0:
        z = np.zeros(0, dtype=np.int32)
        return z, np.zeros(1, dtype=np.int32), z, np.zeros((0, pages), dtype=np.int32)
    ctx = seq - q  # keys already cached before this step's queries
    last_start = (seq - 1) // C * C  # start of the chunk holding each request's last query
    if (last_start <= ctx).all():
        # every request's queries sit in one chunk (always so for decode): one virtual batch each
        return (q.astype(np.int32), qsl.astype(np.int32), (seq - last_start).astype(np.int32),
                _chunk_pages(bt, np.arange(B), last_start // block_size, pages))
    # queries in the chunk where the step starts (it may be partly filled by the context)
    q_first = np.minimum(C - ctx % C, q)
    n_virtual = 1 + cdiv_np(q - q_first, C)  # chunks touched by each request's queries
    cu_v = np.cumsum(n_virtual)
    V = int(cu_v[-1])
    req = np.repeat(np.arange(B), n_virtual)
    k = np.arange(V) - (cu_v - n_virtual)[req]  # index of the chunk within its request
    # queries: the first chunk takes q_first, the middle ones C, the last the rest
    seqlens_q = np.where(k == 0, q_first[req], np.minimum(q[req] - q_first[req] - C * (k - 1), C))
    # keys: full chunks except the last one of each request, which ends at seq_len
    seqlens_k = np.full(V, C, dtype=np.int32)
    seqlens_k[cu_v - 1] = seq - last_start
    # key start of each virtual batch: counted back from the request's last chunk
    k_start = last_start[req] - (n_virtual[req] - 1 - k) * C
    cu_q = np.zeros(V + 1, dtype=np.int32)
    np.cumsum(seqlens_q, out=cu_q[1:])
    return (seqlens_q.astype(np.int32), cu_q, seqlens_k,
            _chunk_pages(bt, req, k_start // block_size, pages))


def _chunk_pages(bt: np.ndarray, rows: np.ndarray, first: np.ndarray, pages: int) -> np.ndarray:
    """``bt[rows[v], first[v] + j]`` for ``j < pages``, the column clipped to the table's last one
    exactly as vLLM does (a chunk that runs past the table repeats the row's last entry)."""
    W = bt.shape[1] if bt.ndim == 2 else 0
    if W == 0:
        return np.zeros((len(rows), pages), dtype=np.int32)
    cols = np.minimum(np.asarray(first)[:, None] + np.arange(pages), W - 1)
    return bt[np.asarray(rows)[:, None], cols].astype(np.int32, copy=False)


def cdiv_np(a, b):
    return -(a // -b)
