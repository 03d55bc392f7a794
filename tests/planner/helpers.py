"""Shared checks for the planner tests: an independent recomputation of a plan, and state snapshots."""

from __future__ import annotations

import copy
from itertools import accumulate

import numpy as np

from ray_attn.planner import Planner


def snapshot(p: Planner):
    """Everything a failed call must leave untouched."""
    T, pool = p.table, p.pool
    return copy.deepcopy((
        T.block_table, T.num_blocks, T.num_computed, T.num_hashed, T.last_hash, dict(T.slot_of),
        list(T.id_of_slot), list(T._free), pool.ref_cnt, list(pool._free), list(pool._evictable),
        dict(pool._block_of), dict(pool._key_of), pool.num_shared_blocks, dict(p._freed),
    ))


def same_state(a, b) -> bool:
    for x, y in zip(a, b):
        if isinstance(x, np.ndarray):
            if not np.array_equal(x, y):
                return False
        elif x != y:
            return False
    return True


def check_plan(p: Planner, plan, tokens: dict, computed_before: dict | None = None):
    """Recompute every array of ``plan`` from the planner's per-request block lists, token by token.
    ``tokens[req_id]`` is the request's token list; ``computed_before`` (optional) what the test
    expects ``num_computed_tokens`` to be."""
    a = plan.attn
    bs = p.block_size
    B = len(plan.req_ids)
    assert a.query_start_loc.dtype == np.int32 and a.query_start_loc.shape == (B + 1,)
    assert a.query_start_loc[0] == 0
    q = np.diff(a.query_start_loc)
    N = int(a.query_start_loc[-1])
    assert a.num_actual_tokens == N
    assert plan.input_token_ids.shape == plan.positions.shape == a.slot_mapping.shape
    assert len(a.slot_mapping) >= N and (a.slot_mapping[N:] == -1).all()
    assert (plan.positions[N:] == 0).all() and (plan.input_token_ids[N:] == 0).all()
    for arr in (a.seq_lens, a.block_table, a.slot_mapping, plan.positions, plan.input_token_ids,
                plan.logits_indices, plan.num_computed_tokens):
        assert arr.dtype == np.int32
    assert a.block_table.ndim == 2 and a.block_table.shape[0] == B
    for i, rid in enumerate(plan.req_ids):
        c = int(plan.num_computed_tokens[i])
        if computed_before is not None:
            assert c == computed_before[rid], (rid, c, computed_before[rid])
        s = c + int(q[i])
        assert a.seq_lens[i] == s
        blocks = p.block_ids(rid).tolist()
        assert len(blocks) >= -(-s // bs)
        row = a.block_table[i].tolist()
        assert not any(row[len(blocks):])
        for j, (used, now) in enumerate(zip(row, blocks)):
            if used != now:  # deduplicated after the plan: the step wrote a copy of `now`'s content
                assert j < s // bs and p.pool.is_cached(now) and p.pool.ref_cnt[used] == 0
        blocks = row[: len(blocks)]
        lo, hi = a.query_start_loc[i], a.query_start_loc[i + 1]
        pos = list(range(c, s))
        assert plan.positions[lo:hi].tolist() == pos
        assert a.slot_mapping[lo:hi].tolist() == [blocks[t // bs] * bs + t % bs for t in pos]
        assert plan.input_token_ids[lo:hi].tolist() == list(tokens[rid][c:s])
        assert plan.logits_indices[i] == hi - 1
    assert a.max_query_len == (int(q.max()) if B else 0)
    assert a.max_seq_len == (int(a.seq_lens.max()) if B else 0)
    # no slot is written twice in one step
    real = a.slot_mapping[:N]
    assert len(np.unique(real)) == N
    return q


def prefix_keys(tokens) -> list:
    """Per position p, a key of ``tokens[: p + 1]``: what the K/V at p depends on (every layer
    mixes in the whole prefix), so two slots hold the same K/V exactly when their keys match."""
    return list(accumulate(map(int, tokens), lambda h, t: hash((h, t)), initial=0))[1:]


class KVOracle:
    """The cache's contents, replayed from the plans: each step first writes every scheduled token's
    key at its slot (a layer writes the whole step's K/V before its attention reads any), then
    every row must find, at each position it attends to, the key of its own prefix -- whichever row
    of whichever step wrote it.  Blocks keep their contents when freed, as memory does."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.slots: dict[int, int] = {}

    def step(self, plan, tokens: dict) -> None:
        a, bs = plan.attn, self.block_size
        N = a.num_actual_tokens
        written = a.slot_mapping[:N]
        assert len(np.unique(written)) == N, "a slot is written twice in one step"
        assert (written >= 0).all()
        keys = {rid: prefix_keys(tokens[rid]) for rid in plan.req_ids}
        qsl = a.query_start_loc
        for i, rid in enumerate(plan.req_ids):
            for t in range(qsl[i], qsl[i + 1]):
                self.slots[int(written[t])] = keys[rid][int(plan.positions[t])]
        for i, rid in enumerate(plan.req_ids):
            row, k = a.block_table[i], keys[rid]
            for pos in range(int(a.seq_lens[i])):
                slot = int(row[pos // bs]) * bs + pos % bs
                assert self.slots.get(slot) == k[pos], f"{rid!r} reads a wrong K/V at position {pos}"
