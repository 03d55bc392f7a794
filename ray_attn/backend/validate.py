"""Input checks for ``FlashAttentionImpl.forward``, all made before the KV cache is written.

A bad argument must raise an error that names it, never reach a kernel: FlashAttention 3 given a
missing page table reads the cache as if unpaged and kills the process, and an out-of-range block
id or length is an illegal memory access that poisons the CUDA context.  So:
- structure (presence, type, dtype, device, shape of every array the chosen path reads) is
  checked on every call -- it reads no values, so it costs no device sync;
- values (lengths that agree, block ids inside the cache, tables wide enough) are checked once per
  metadata object: directly when it lives on the CPU, through one host copy per step when a caller
  hands us device metadata.  The worker checks its numpy plan before the step's single device copy
  and marks the metadata ``host_checked`` (as do CUDA graphs, whose replays load checked plans),
  so its per-layer hot path never syncs.
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
    for name, t in (("key", key), ("value", value), ("output", output), ("kv_cache", kv_cache)):
        if t.device != query.device:
            raise _bad(f"{name} is on {t.device} but query is on {query.device}")
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
    check_metadata_structure(m, query.device, impl.use_irope)
    cascade = m.use_cascade and not (impl.use_irope and m.local_attn_metadata is not None)
    if cascade and impl.alibi_slopes is not None:
        raise _bad("cascade attention does not support ALiBi (its bias needs absolute "
                   "positions, which the non-causal prefix pass does not have)")
    if m.host_checked or is_capturing(query):
        return  # the planner's plan, checked by the worker (or a graph's placeholders)
    left = impl.sliding_window[0]
    if cascade and left >= 0 and m.max_seq_len - 1 > left:
        raise _bad(f"cascade attention with sliding_window={left + 1} needs every query's window to "
                   f"cover the shared prefix, but max_seq_len={m.max_seq_len} lets it clip")
    if not getattr(m, "_values_checked", False):  # once per metadata object, not per layer
        check_metadata_values(m, num_blocks=kv_cache.shape[1], block_size=kv_cache.shape[2])
        m._values_checked = True


def is_capturing(t: torch.Tensor) -> bool:
    # Values cannot be read back while a CUDA graph is being captured; the capture's metadata are
    # placeholders, and what a replay reads was checked on the host when it was loaded.
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _fields(m, use_irope: bool) -> list[tuple[str, object, int]]:
    """(name, array, ndim) of every array a forward over ``m`` reads."""
    f = [("query_start_loc", m.query_start_loc, 1), ("seq_lens", m.seq_lens, 1),
         ("block_table", m.block_table, 2), ("slot_mapping", m.slot_mapping, 1)]
    if m.use_cascade:
        f += [("cu_prefix_query_lens", m.cu_prefix_query_lens, 1), ("prefix_kv_lens", m.prefix_kv_lens, 1),
              ("prefix_block_table", m.prefix_block_table, 2), ("suffix_kv_lens", m.suffix_kv_lens, 1),
              ("suffix_block_table", m.suffix_block_table, 2)]
    loc = m.local_attn_metadata
    if use_irope and loc is not None:
        f += [("local_attn_metadata.local_query_start_loc", loc.local_query_start_loc, 1),
              ("local_attn_metadata.local_seqused_k", loc.local_seqused_k, 1),
              ("local_attn_metadata.local_block_table", loc.local_block_table, 2)]
    return f


# vLLM keeps its slot mapping in int64 (``slot_mapping_cpu``) and ``reshape_and_cache_flash`` takes
# it so; our planner sends int32.  Both cache writes read either width as it is (no conversion on
# the hot path), so both are accepted.  Every other array is an int32 argument of the kernels.
_DTYPES = {"slot_mapping": (torch.int32, torch.int64)}


def check_metadata_structure(m, device: torch.device, use_irope: bool = False) -> None:
    """Every array the forward reads is there, an int32 tensor (the slot mapping int32 or int64)
    on ``device``, of the right rank."""
    for name, a, ndim in _fields(m, use_irope):
        if a is None:
            why = " (use_cascade=True)" if name.startswith(("cu_prefix", "prefix", "suffix")) else ""
            raise _bad(f"attn_metadata.{name} is missing{why}")
        if not isinstance(a, torch.Tensor):
            raise _bad(f"attn_metadata.{name} must be a torch.Tensor on {device}, got {type(a).__name__} "
                       "(FlashAttentionMetadata.to_device moves the planner's arrays)")
        if a.dtype not in _DTYPES.get(name, (torch.int32,)):
            want = " or ".join(str(d).removeprefix("torch.") for d in _DTYPES.get(name, (torch.int32,)))
            raise _bad(f"attn_metadata.{name} must be {want}, got {a.dtype}")
        if a.device != device:
            raise _bad(f"attn_metadata.{name} is on {a.device} but query is on {device}")
        if a.dim() != ndim:
            raise _bad(f"attn_metadata.{name} must have {ndim} dimension(s), got shape {tuple(a.shape)}")
        if ndim == 2 and a.stride(-1) != 1:
            raise _bad(f"attn_metadata.{name} must have contiguous rows (stride(-1) == 1)")


def complete_seed_cascade(m, block_size: int) -> None:
    """Fill the fields vLLM's builder leaves out, as vLLM's ``cascade_attention`` derives them.

    The seed's metadata carries one shared prefix (``common_prefix_len`` tokens, whole blocks,
    read from the first row of ``block_table``) and no prefix/suffix tables: the prefix pass reads
    ``block_table[:1]`` and the suffix pass ``block_table[:, common_prefix_len // block_size:]``.
    Filled once, on the shared metadata object, so every later layer finds the tables.
    """
    c = m.common_prefix_len
    if c <= 0 or c % block_size:
        raise _bad(f"cascade metadata without prefix_block_table needs common_prefix_len to be a positive "
                   f"multiple of block_size={block_size}, got {c}")
    cu = m.cu_prefix_query_lens
    if cu is None or len(cu) != 2:
        got = None if cu is None else len(cu)
        raise _bad("cascade metadata without prefix_block_table describes one shared prefix: "
                   f"cu_prefix_query_lens must have 2 entries, got {got}")
    if m.block_table is None or m.block_table.shape[1] <= c // block_size:
        raise _bad(f"block_table needs more than common_prefix_len // block_size = {c // block_size} columns "
                   "(every request has a suffix after the shared prefix)")
    blocks = c // block_size
    m.prefix_block_table = m.block_table[:1, :blocks]
    m.suffix_block_table = m.block_table[:, blocks:]
    if not m.max_suffix_kv_len:
        m.max_suffix_kv_len = m.max_seq_len - c


def _np(a) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else a.cpu().numpy()


def _check_table(name: str, table, lens: np.ndarray, num_blocks: int, block_size: int) -> None:
    """``table`` has a row per length, wide enough for it, and every block it uses exists."""
    bt = _np(table)
    if bt.shape[0] != lens.shape[0]:
        raise _bad(f"{name} has {bt.shape[0]} rows for {lens.shape[0]} sequences")
    need = -(-lens // block_size)
    if lens.size and need.max() > bt.shape[1]:
        raise _bad(f"{name} has {bt.shape[1]} columns but a sequence needs {need.max()} blocks")
    # The worker runs this every step: a min/max pass over the whole table first (the unused tail
    # of each row is 0 by contract), and the exact per-row mask only when that pass finds a suspect.
    if lens.size and bt.size and (bt.min() < 0 or bt.max() >= num_blocks):
        used = bt[np.arange(bt.shape[1])[None, :] < need[:, None]]
        bad = used[(used < 0) | (used >= num_blocks)]
        if bad.size:
            raise _bad(f"{name}: block id {int(bad[0])} is outside the cache (num_blocks={num_blocks})")


def _check_starts(name: str, starts: np.ndarray, count: int, total: int) -> np.ndarray:
    """Cumulative offsets of ``count`` segments covering ``total`` tokens; returns the lengths."""
    if starts.shape != (count + 1,):
        raise _bad(f"{name} has {starts.shape[0]} entries for {count} sequences (want {count + 1})")
    lens = np.diff(starts)
    if starts[0] != 0 or (lens < 0).any():
        raise _bad(f"{name} must start at 0 and not decrease, got {starts.tolist()}")
    if starts[-1] != total:
        raise _bad(f"{name} ends at {starts[-1]} but num_actual_tokens={total}")
    return lens


def check_metadata_values(m, num_blocks: int, block_size: int) -> None:
    """Lengths that agree with each other and block ids that exist in the cache."""
    seq_lens = _np(m.seq_lens)
    B, n = seq_lens.shape[0], m.num_actual_tokens
    qsl = _np(m.query_start_loc)
    q_lens = _check_starts("query_start_loc", qsl, B, n)
    short = np.nonzero(seq_lens < q_lens)[0]
    if short.size:
        i = int(short[0])
        raise _bad(f"sequence {i}: seq_len={seq_lens[i]} is shorter than its query length {q_lens[i]}")
    if B and q_lens.max() > m.max_query_len:
        raise _bad(f"max_query_len={m.max_query_len} is below the longest query {q_lens.max()}")
    if B and seq_lens.max() > m.max_seq_len:
        raise _bad(f"max_seq_len={m.max_seq_len} is below the longest sequence {seq_lens.max()}")
    _check_table("block_table", m.block_table, seq_lens, num_blocks, block_size)
    if m.slot_mapping.shape[0] < n:
        raise _bad(f"slot_mapping has {m.slot_mapping.shape[0]} entries for num_actual_tokens={n}")
    slots = _np(m.slot_mapping)[:n]
    # Negative slots are padding (vLLM's PAD_SLOT_ID is -1) and are skipped by the cache write.
    if slots.size and slots.max() >= num_blocks * block_size:
        bad = slots[slots >= num_blocks * block_size]
        raise _bad(f"slot {int(bad[0])} is outside the cache ({num_blocks} blocks x {block_size})")
    if m.use_cascade and m.prefix_block_table is not None:
        _check_cascade_values(m, qsl, q_lens, seq_lens, num_blocks, block_size)
    if m.local_attn_metadata is not None:
        _check_local_values(m.local_attn_metadata, n, num_blocks, block_size)


def _check_cascade_values(m, qsl, q_lens, seq_lens, num_blocks, block_size) -> None:
    cu = _np(m.cu_prefix_query_lens)
    prefix = _np(m.prefix_kv_lens)
    G = prefix.shape[0]
    _check_starts("cu_prefix_query_lens", cu, G, m.num_actual_tokens)
    if not np.isin(cu, qsl).all():
        raise _bad(f"cu_prefix_query_lens {cu.tolist()} splits a request's queries across prefix groups "
                   f"(every entry must be in query_start_loc)")
    if G and (prefix.min() < 0 or prefix.max() > m.common_prefix_len):
        raise _bad(f"prefix_kv_lens {prefix.tolist()} must lie within [0, common_prefix_len="
                   f"{m.common_prefix_len}]")
    _check_table("prefix_block_table", m.prefix_block_table, prefix, num_blocks, block_size)
    suffix = _np(m.suffix_kv_lens)
    if suffix.shape != seq_lens.shape:
        raise _bad(f"suffix_kv_lens has {suffix.shape[0]} entries for {seq_lens.shape[0]} sequences")
    group = np.searchsorted(cu, qsl[:-1], side="right") - 1  # each request's prefix group
    want = seq_lens - prefix[np.clip(group, 0, max(G - 1, 0))] if G else seq_lens
    wrong = np.nonzero(suffix != want)[0]
    if wrong.size:
        i = int(wrong[0])
        raise _bad(f"sequence {i}: suffix_kv_lens={suffix[i]} but seq_len - its group's prefix = {want[i]}")
    short = np.nonzero(suffix < q_lens)[0]
    if short.size:
        i = int(short[0])
        raise _bad(f"sequence {i}: suffix_kv_len={suffix[i]} is shorter than its query length {q_lens[i]} "
                   "(the shared prefix must end before the step's first query)")
    if suffix.size and suffix.max() > m.max_suffix_kv_len:
        raise _bad(f"max_suffix_kv_len={m.max_suffix_kv_len} is below the longest suffix {suffix.max()}")
    _check_table("suffix_block_table", m.suffix_block_table, suffix, num_blocks, block_size)


def _check_local_values(loc, num_tokens: int, num_blocks: int, block_size: int) -> None:
    k = _np(loc.local_seqused_k)
    q = _check_starts("local_query_start_loc", _np(loc.local_query_start_loc), k.shape[0], num_tokens)
    short = np.nonzero(k < q)[0]
    if short.size:
        i = int(short[0])
        raise _bad(f"virtual batch {i}: local_seqused_k={k[i]} is shorter than its query length {q[i]}")
    if k.size and (k.max() > loc.local_max_seq_len or q.max() > loc.local_max_query_len):
        raise _bad(f"local_max_seq_len={loc.local_max_seq_len} / local_max_query_len="
                   f"{loc.local_max_query_len} are below the longest virtual batch ({k.max()} / {q.max()})")
    _check_table("local_block_table", loc.local_block_table, k, num_blocks, block_size)
