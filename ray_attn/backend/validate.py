"""Input checks for ``FlashAttentionImpl.forward``, all made before the KV cache is written.

Shape and dtype checks are free.  Value checks (lengths, block ids) read the metadata, so they
run when it lives on the CPU -- the reference kernel, and the worker's numpy plan before its one
device copy per step -- and never force a GPU sync in the per-layer hot path.
"""

from __future__ import annotations

import numpy as np
import torch

from ray_attn.backend.cache import FP8_DTYPE


def _bad(msg: str) -> ValueError:
    return ValueError(msg)


def check_forward_inputs(impl, query, key, value, kv_cache, m, output) -> None:
    H, Hk, D = impl.num_heads, impl.num_kv_heads, impl.head_size
    if query.dim() != 3 or query.shape[1:] != (H, D):
        raise _bad(f"query must be [num_tokens, {H}, {D}], got {tuple(query.shape)}")
    T = query.shape[0]
    for name, t in (("key", key), ("value", value)):
        if t.shape != (T, Hk, D):
            raise _bad(f"{name} must be [{T}, {Hk}, {D}] to match query, got {tuple(t.shape)}")
    if output.shape != query.shape:
        raise _bad(f"output must match query's shape {tuple(query.shape)}, got {tuple(output.shape)}")
    for name, t in (("key", key), ("value", value), ("output", output)):
        if t.dtype != query.dtype:
            raise _bad(f"{name} dtype {t.dtype} differs from query dtype {query.dtype}")
    want = FP8_DTYPE if impl.fp8 else query.dtype
    if kv_cache.dtype not in (want, torch.uint8 if impl.fp8 else want):
        raise _bad(f"kv_cache dtype must be {want} for kv_cache_dtype={impl.kv_cache_dtype!r}, got {kv_cache.dtype}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != (Hk, D):
        raise _bad(f"kv_cache must be [2, num_blocks, block_size, {Hk}, {D}], got {tuple(kv_cache.shape)}")
    if kv_cache.shape[2] != impl.block_size:
        raise _bad(f"kv_cache block_size {kv_cache.shape[2]} differs from the impl's block_size {impl.block_size}")
    n = m.num_actual_tokens
    if not 0 <= n <= T:
        raise _bad(f"num_actual_tokens={n} must be within [0, {T}] (the query has {T} tokens)")
    if m.slot_mapping.shape[0] < n:
        raise _bad(f"slot_mapping has {m.slot_mapping.shape[0]} entries for num_actual_tokens={n}")
    if isinstance(m.seq_lens, np.ndarray) or m.seq_lens.device.type == "cpu":
        check_metadata_values(m, num_blocks=kv_cache.shape[1], block_size=kv_cache.shape[2])


def _np(a) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else a.cpu().numpy()


def check_metadata_values(m, num_blocks: int, block_size: int) -> None:
    """Lengths that agree with each other and block ids that exist in the cache."""
    qsl, seq_lens, bt = _np(m.query_start_loc), _np(m.seq_lens), _np(m.block_table)
    B = seq_lens.shape[0]
    if qsl.shape != (B + 1,):
        raise _bad(f"query_start_loc has {qsl.shape[0]} entries for {B} sequences (want {B + 1})")
    q_lens = np.diff(qsl)
    if qsl[0] != 0 or (q_lens < 0).any():
        raise _bad(f"query_start_loc must start at 0 and not decrease, got {qsl.tolist()}")
    if qsl[-1] != m.num_actual_tokens:
        raise _bad(f"query_start_loc ends at {qsl[-1]} but num_actual_tokens={m.num_actual_tokens}")
    short = np.nonzero(seq_lens < q_lens)[0]
    if short.size:
        i = int(short[0])
        raise _bad(f"sequence {i}: seq_len={seq_lens[i]} is shorter than its query length {q_lens[i]}")
    if B and q_lens.max() > m.max_query_len:
        raise _bad(f"max_query_len={m.max_query_len} is below the longest query {q_lens.max()}")
    if B and seq_lens.max() > m.max_seq_len:
        raise _bad(f"max_seq_len={m.max_seq_len} is below the longest sequence {seq_lens.max()}")
    need = -(-seq_lens // block_size)
    if B and need.max() > bt.shape[1]:
        raise _bad(f"block_table has {bt.shape[1]} columns but a sequence needs {need.max()} blocks")
    # The worker runs this every step: a min/max pass over the whole table first (the unused tail
    # of each row is 0 by contract), and the exact per-row mask only when that pass finds a suspect.
    if B and bt.size and (bt.min() < 0 or bt.max() >= num_blocks):
        used = bt[np.arange(bt.shape[1])[None, :] < need[:, None]]
        bad = used[(used < 0) | (used >= num_blocks)]
        if bad.size:
            raise _bad(f"block id {int(bad[0])} is outside the cache (num_blocks={num_blocks})")
    slots = _np(m.slot_mapping)[: m.num_actual_tokens]
    if slots.size and (slots.min() < -1 or slots.max() >= num_blocks * block_size):
        bad = slots[(slots < -1) | (slots >= num_blocks * block_size)]
        raise _bad(f"slot {int(bad[0])} is outside the cache ({num_blocks} blocks x {block_size})")
