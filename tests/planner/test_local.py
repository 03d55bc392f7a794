"""make_local_attention_virtual_batches: vLLM's worked example, edge cases, a brute-force oracle."""

import numpy as np
import pytest

from ray_attn.planner import PlannerConfigError, make_local_attention_virtual_batches


def _qsl(q):
    return np.concatenate([[0], np.cumsum(q)]).astype(np.int32)


def brute_force(C, q_lens, k_lens, block_table, bs):
    """One virtual batch per (request, chunk touched by the request's queries), built token by token."""
    sq, sk, rows = [], [], []
    for r, (q, k) in enumerate(zip(q_lens, k_lens)):
        chunks = {}
        for p in range(k - q, k):
            chunks.setdefault(p // C, []).append(p)
        for c in sorted(chunks):
            sq.append(len(chunks[c]))
            sk.append(min(k, (c + 1) * C) - c * C)
            first = c * C // bs
            # vLLM clips the column index to the table's last column (the seed, exactly)
            last = len(block_table[r]) - 1
            row = [block_table[r][min(j, last)] for j in range(first, first + C // bs)]
            rows.append(row)
    return sq, sk, rows


def test_vllm_worked_example():
    bt = np.arange(30, dtype=np.int32).reshape(3, 10)
    sq, cuq, sk, tab = make_local_attention_virtual_batches(4, _qsl([4, 10, 5]), np.array([6, 17, 9]), bt, 2)
    assert sq.tolist() == [2, 2, 1, 4, 4, 1, 4, 1]
    assert cuq.tolist() == [0, 2, 4, 5, 9, 13, 14, 18, 19]
    assert sk.tolist() == [4, 2, 4, 4, 4, 1, 4, 1]
    assert tab.tolist() == [[0, 1], [2, 3], [12, 13], [14, 15], [16, 17], [18, 19], [22, 23], [24, 25]]
    for a in (sq, cuq, sk, tab):
        assert a.dtype == np.int32


def test_single_chunk_per_request():
    # every request lies inside one chunk: one virtual batch each, equal to the batch itself
    bt = np.arange(12, dtype=np.int32).reshape(3, 4) + 1
    q, k = [3, 1, 5], [7, 2, 8]
    sq, cuq, sk, tab = make_local_attention_virtual_batches(8, _qsl(q), np.array(k), bt, 2)
    assert sq.tolist() == q and sk.tolist() == k
    assert cuq.tolist() == _qsl(q).tolist()
    assert tab.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]


def test_chunk_wider_than_block_table_repeats_the_last_column():
    bt = np.array([[5, 6]], dtype=np.int32)  # 2 pages of 4 tokens; chunk = 4 pages
    sq, cuq, sk, tab = make_local_attention_virtual_batches(16, _qsl([3]), np.array([7]), bt, 4)
    assert tab.tolist() == [[5, 6, 6, 6]]  # as vLLM's clip(max=W - 1), not zeros
    assert sq.tolist() == [3] and sk.tolist() == [7]


def test_seq_len_multiple_of_chunk():
    bt = np.arange(8, dtype=np.int32)[None]
    sq, cuq, sk, tab = make_local_attention_virtual_batches(4, _qsl([8]), np.array([8]), bt, 2)
    assert sq.tolist() == [4, 4] and sk.tolist() == [4, 4]
    assert tab.tolist() == [[0, 1], [2, 3]]


def test_empty_batch():
    sq, cuq, sk, tab = make_local_attention_virtual_batches(4, np.zeros(1, np.int32), np.zeros(0, np.int32),
                                                            np.zeros((0, 3), np.int32), 2)
    assert sq.size == 0 and cuq.tolist() == [0] and tab.shape == (0, 2)


@pytest.mark.parametrize("C,bs", [(4, 2), (8, 4), (16, 16), (32, 8)])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("decode", [False, True])
def test_matches_brute_force(C, bs, seed, decode):
    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 7))
    k = rng.integers(1, 5 * C, B)
    q = np.ones(B, dtype=np.int64) if decode else np.minimum(k, rng.integers(1, 3 * C, B))
    width = int(-(-k.max() // bs)) + int(rng.integers(0, 3))
    bt = rng.integers(1, 1000, (B, width)).astype(np.int32)
    sq, cuq, sk, tab = make_local_attention_virtual_batches(C, _qsl(q), k, bt, bs)
    esq, esk, erows = brute_force(C, q.tolist(), k.tolist(), bt.tolist(), bs)
    assert sq.tolist() == esq
    assert sk.tolist() == esk
    assert tab.tolist() == erows
    assert cuq.tolist() == _qsl(esq).tolist()


@pytest.mark.parametrize("C,bs", [(6, 4), (0, 2), (-4, 2)])
def test_chunk_not_a_multiple_of_block_size(C, bs):
    with pytest.raises(PlannerConfigError, match=str(C)):
        make_local_attention_virtual_batches(C, _qsl([1]), np.array([1]), np.zeros((1, 1), np.int32), bs)
