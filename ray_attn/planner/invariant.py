"""Cascade attention that keeps batch-invariant mode invariant: a fixed grid of prefix boundaries.

Why: in batch-invariant mode (``ParallelConfig.batch_invariant``) every row's result must not
depend on the rest of its step, so that speculative greedy gives plain greedy's tokens (issue 40).
Ordinary cascade breaks that twice. Whether a step cascades, and where a row's shared prefix
ends, depend on which other requests the step holds; and a cascaded row's attention is a merge of
a prefix pass and a suffix pass, which rounds differently from one pass over the same keys.

The grid makes the split a function of the token's position alone. A token at position ``t`` is
attended as a prefix pass over ``[0, P)`` and a suffix pass over ``[P, t]``, merged by LSE, with
``P = (t // grid) * grid``; below the first grid line (``P = 0``) the prefix pass is empty and the
merge returns the suffix pass's bits (``merge.py``). So a token's attention is computed the same
way in a prefill chunk, a decode step, a verifying query, alone or in a batch, and whoever wrote
its prefix-cached KV wrote the same bits. For that:

- no query spans a grid line: prefill chunks end at the next one (``Scheduler.schedule``) and a
  row's drafts stop before it (``SpecDecoder.propose``), so a row's tokens share one ``P``;
- rows group by their prefix blocks, whoever else is in the step: requests that share a prompt
  past a grid line read that prefix once, as cascade means to;
- the step cascades whenever some row is past the first line, whatever it costs or saves.

It is off (no cascade in the mode) where cascade is refused anyway: ALiBi, sliding windows and
chunked local attention, or ``enable_cascade=False``.
"""

from __future__ import annotations

import numpy as np

from .cascade import CascadeChoice
from .errors import InvalidRequestError


def cascade_grid(config) -> int | None:
    """The grid, in tokens, of ``config`` (an ``EngineConfig``); None: no cascade in the mode, or
    not in the mode."""
    p, m = config.parallel, config.model
    if not p.batch_invariant or not p.batch_invariant_cascade_grid or not config.enable_cascade:
        return None
    kinds = set(m.layer_kinds())
    if m.use_alibi or "sliding_attention" in kinds or "chunked_attention" in kinds:
        return None
    return p.batch_invariant_cascade_grid


def grid_room(position: int, grid: int | None) -> int | None:
    """How many tokens a query starting at ``position`` may hold without crossing a grid line
    (None: no grid)."""
    return None if grid is None else grid - position % grid


def check_grid(grid: int, ids, computed: np.ndarray, q: np.ndarray) -> None:
    """Refuse a step in which some row's query crosses a grid line (the planner calls it before
    it allocates anything; the scheduler never plans one)."""
    first = np.asarray(computed, dtype=np.int64)
    last = first + np.asarray(q, dtype=np.int64) - 1
    crossing = np.flatnonzero(last // grid != first // grid)
    if len(crossing):
        i = int(crossing[0])
        raise InvalidRequestError(
            f"request {ids[i]!r}: its query (positions {int(first[i])}..{int(last[i])}) crosses the "
            f"batch-invariant cascade grid line at {(int(first[i]) // grid + 1) * grid}; prefill chunks and "
            "drafts must stop at it (planner/invariant.py)")


def grid_cascade(grid: int, block_size: int, block_table: np.ndarray, computed: np.ndarray) -> CascadeChoice:
    """The step's cascade on the grid: rows grouped by their prefix ``[0, P)``, every row through
    the cascade path once any row has ``P > 0`` (a row below the first line in a group of prefix
    0). ``computed``: each row's first query position (``check_grid`` held its last one below the
    next line)."""
    pb = np.asarray(computed, dtype=np.int64) // grid * (grid // block_size)  # each row's prefix in blocks
    if not pb.any():
        return CascadeChoice(False, f"batch-invariant cascade: no query past the first grid line ({grid})")
    # A row's prefix is named by its length and its last block: rows share a block only through
    # the prefix cache, whose hashes chain over every token before it, so the same block at the
    # same column means the same tokens before it (and, in this mode, the same KV bits). One 1-D
    # unique, not a row-wise one over the table (milliseconds at 256 rows of 256 blocks); block
    # ids are int32, so the pair packs into one int64 without reading the rest of the table.
    last = np.where(pb > 0, block_table[np.arange(len(pb)), np.maximum(pb - 1, 0)], -1).astype(np.int64)
    keys = (pb << 32) | (last + 1)
    _, first, labels = np.unique(keys, return_index=True, return_inverse=True)
    labels = labels.reshape(-1)
    # groups numbered by first appearance, as ``find_prefix_groups`` numbers them
    order = np.argsort(first, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    refs = first[order]
    return CascadeChoice(True, f"batch-invariant cascade: grid {grid}, {len(refs)} groups",
                         rank[labels], pb[refs], refs, reusable=False)
