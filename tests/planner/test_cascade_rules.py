"""use_cascade_attention (vLLM's rules), the multi-group extension, and prefix-group detection."""

import itertools

import numpy as np
import pytest

from ray_attn.planner import (
    cascade_verdict,
    common_prefix_blocks,
    find_prefix_groups,
    multi_group_cascade_verdict,
    use_cascade_attention,
)


def cdiv(a, b):
    return -(-a // b)


def vllm_rules(common_prefix_len, query_lens, num_query_heads, num_kv_heads, use_alibi,
               use_sliding_window, num_sms):
    """vLLM v1 flash_attn.use_cascade_attention, restated rule by rule as the oracle."""
    if common_prefix_len < 256:
        return False
    if use_alibi or use_sliding_window:
        return False
    num_reqs = len(query_lens)
    if num_reqs < 8:
        return False
    num_queries_per_kv = num_query_heads // num_kv_heads
    use_flash_decoding = (num_queries_per_kv > 1 and not use_sliding_window and not use_alibi
                          and np.all(query_lens == 1))
    if not use_flash_decoding:
        return True
    num_prefix_tiles = cdiv(common_prefix_len, 128)
    cascade_ctas = num_query_heads * cdiv(num_reqs, 128)
    cascade_time = cdiv(cascade_ctas, num_sms) * num_prefix_tiles
    fd_ctas = num_reqs * num_kv_heads * cdiv(num_queries_per_kv, 128) * num_prefix_tiles
    return cascade_time < cdiv(fd_ctas, num_sms)


GRID = list(itertools.product(
    [0, 255, 256, 1024, 8192],  # common prefix
    [7, 8, 64, 300, 2000],  # requests
    [(32, 32), (32, 8), (8, 1), (128, 1)],  # heads
    [False, True],  # alibi
    [False, True],  # sliding window
    [132, 16],  # SMs
    [False, True],  # all decode
))


@pytest.mark.parametrize("prefix,B,heads,alibi,window,sms,decode", GRID)
def test_use_cascade_attention_matches_vllm(prefix, B, heads, alibi, window, sms, decode):
    q = np.ones(B, dtype=np.int32)
    if not decode:
        q[0] = 5
    args = (prefix, q, heads[0], heads[1], alibi, window, sms)
    assert use_cascade_attention(*args) == vllm_rules(*args)


def test_rules_one_by_one():
    dec = np.ones(64, dtype=np.int32)
    assert not use_cascade_attention(255, dec, 32, 8, False, False, 132)  # prefix too short
    assert not use_cascade_attention(4096, dec, 32, 8, True, False, 132)  # ALiBi
    assert not use_cascade_attention(4096, dec, 32, 8, False, True, 132)  # sliding window
    assert not use_cascade_attention(4096, dec[:7], 32, 8, False, False, 132)  # < 8 requests
    assert use_cascade_attention(4096, dec, 32, 32, False, False, 132)  # MHA: no flash-decoding
    mixed = dec.copy()
    mixed[3] = 2
    assert use_cascade_attention(4096, mixed, 32, 8, False, False, 132)  # prefill: no flash-decoding
    # flash-decoding eligible: cost model.  64 reqs, 32 heads, 8 kv heads, 4096 prefix (32 tiles):
    # cascade = cdiv(32 * 1, 132) * 32 = 32; fd = cdiv(64 * 8 * 1 * 32, 132) = 125
    ok, why = cascade_verdict(4096, dec, 32, 8, False, False, 132)
    assert ok and "32 < flash-decoding 125" in why
    # 8 requests: fd = cdiv(8 * 8 * 32, 132) = 16 < 32 -> flash-decoding wins
    ok, why = cascade_verdict(4096, dec[:8], 32, 8, False, False, 132)
    assert not ok and "16 <= cascade 32" in why


def test_multi_group_reduces_to_vllm_with_one_group():
    for prefix, B, sms in itertools.product([0, 256, 4096], [4, 8, 64, 512], [16, 132]):
        q = np.ones(B, dtype=np.int32)
        for heads in [(32, 8), (32, 32)]:
            assert multi_group_cascade_verdict([prefix], [B], [B], q, *heads, False, False, sms) == \
                cascade_verdict(prefix, q, *heads, False, False, sms)


def test_multi_group_gates():
    q = np.ones(16, dtype=np.int32)
    two = ([512, 512], [8, 8], [8, 8])
    assert not multi_group_cascade_verdict([128, 255], [8, 8], [8, 8], q, 32, 8, False, False, 132)[0]
    assert not multi_group_cascade_verdict(*two, q, 32, 8, True, False, 132)[0]
    assert not multi_group_cascade_verdict(*two, q, 32, 8, False, True, 132)[0]
    assert not multi_group_cascade_verdict([512, 512], [3, 4], [3, 4], q[:7], 32, 8, False, False, 132)[0]
    ok, why = multi_group_cascade_verdict([512] * 16, [1] * 16, [1] * 16, q, 32, 32, False, False, 132)
    assert not ok and "share" in why
    assert multi_group_cascade_verdict(*two, q, 32, 32, False, False, 132)[0]  # no flash-decoding


def wave_model(prefix_lens, group_tokens, group_reqs, H, Hk, sms):
    """The documented multi-group model, computed CTA by CTA."""
    ctas = []
    for P, T in zip(prefix_lens, group_tokens):
        ctas += [cdiv(P, 128)] * (H * cdiv(T, 128))
    ctas.sort(reverse=True)
    cascade = sum(ctas[i] for i in range(0, len(ctas), sms))
    fd = cdiv(sum(n * cdiv(P, 128) for P, n in zip(prefix_lens, group_reqs)) * Hk * cdiv(H // Hk, 128), sms)
    return cascade < fd, cascade, fd


@pytest.mark.parametrize("seed", range(20))
def test_multi_group_cost_model(seed):
    rng = np.random.default_rng(seed)
    G = int(rng.integers(2, 40))
    n = rng.integers(1, 20, G)
    n[0] = max(n[0], 2)
    P = rng.integers(256, 6000, G)
    H, Hk = [(32, 8), (64, 8), (16, 2), (40, 8)][seed % 4]
    sms = int(rng.choice([16, 78, 132]))
    q = np.ones(int(n.sum()), dtype=np.int32)
    ok, why = multi_group_cascade_verdict(P, n, n, q, H, Hk, False, False, sms)
    want, cascade, fd = wave_model(P.tolist(), n.tolist(), n.tolist(), H, Hk, sms)
    assert ok == want
    assert str(cascade) in why and str(fd) in why


# ----------------------------------------------------------------------------------- groups
def table(rows, width=None):
    width = width or max(map(len, rows))
    out = np.zeros((len(rows), width), dtype=np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def test_common_prefix_blocks_vllm_single_group():
    bt = table([[1, 2, 3, 4], [1, 2, 3, 9], [1, 2, 7, 8]])
    assert common_prefix_blocks(bt, np.array([4, 4, 4])) == 2
    assert common_prefix_blocks(bt, np.array([4, 1, 4])) == 1  # capped by computed blocks
    assert common_prefix_blocks(bt, np.array([4, 0, 4])) == 0
    assert common_prefix_blocks(table([[1, 2], [5, 2]]), np.array([2, 2])) == 0


def test_groups_prompts_times_samples():
    # 4 prompts x 3 samples, interleaved in the batch; prompt k owns blocks 100k.., samples diverge
    rows, nxt = [], 1000
    for s in range(3):
        for k in range(4):
            rows.append([100 * k + j for j in range(5)] + [nxt, nxt + 1])
            nxt += 2
    bt = table(rows)
    cap = np.full(12, 7)
    labels, prefix, refs = find_prefix_groups(bt, cap)
    assert labels.tolist() == [0, 1, 2, 3] * 3
    assert prefix.tolist() == [5, 5, 5, 5]
    assert refs.tolist() == [0, 1, 2, 3]


def test_groups_refine_below_a_shared_system_prompt():
    # every request shares 1 system block; 2 families of 4 share 6 more blocks each
    rows, nxt = [], 1000
    for fam in range(2):
        for s in range(4):
            rows.append([7] + [10 * (fam + 1) + j for j in range(6)] + [nxt])
            nxt += 1
    labels, prefix, refs = find_prefix_groups(table(rows), np.full(8, 8))
    assert labels.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert prefix.tolist() == [7, 7]


def test_groups_keep_coarse_group_when_split_does_not_pay():
    # 8 requests share 6 blocks; two of them also share a 7th block: splitting would lose sharing
    rows = [[1, 2, 3, 4, 5, 6, 50 + i] for i in range(6)] + [[1, 2, 3, 4, 5, 6, 99, 100]] * 2
    labels, prefix, _ = find_prefix_groups(table(rows), np.array([7] * 6 + [8, 8]))
    assert labels.tolist() == [0] * 8 and prefix.tolist() == [6]


def test_groups_singletons_and_caps():
    rows = [[1, 2, 3], [1, 2, 3], [4, 5, 6], [1, 2, 8]]
    labels, prefix, refs = find_prefix_groups(table(rows), np.array([3, 1, 3, 3]))
    # rows 0, 1, 3 share block 1 (row 1 has computed only its first block); row 2 is alone
    assert labels.tolist() == [0, 0, 1, 0]
    assert prefix.tolist() == [1, 3]
    assert refs.tolist() == [0, 2]


@pytest.mark.parametrize("seed", range(25))
def test_groups_are_sound(seed):
    """On random tries: each group's prefix is shared by all members and within their caps, and the
    partition shares at least as much as the coarsest (first-block) grouping."""
    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 40))
    depth = int(rng.integers(1, 10))
    # a random trie: each request walks down, branching with some probability
    rows, nodes, nxt = [], {}, 1
    for _ in range(B):
        path, key = [], ()
        for d in range(depth + int(rng.integers(0, 3))):
            choices = nodes.setdefault(key, [])
            if choices and rng.random() < 0.8:
                b = choices[int(rng.integers(len(choices)))]
            else:
                b = nxt
                nxt += 1
                choices.append(b)
            path.append(b)
            key = key + (b,)
        rows.append(path)
    bt = table(rows)
    cap = np.array([int(rng.integers(1, len(r) + 1)) for r in rows])
    labels, prefix, refs = find_prefix_groups(bt, cap)
    G = len(prefix)
    assert sorted(set(labels.tolist())) == list(range(G))
    assert [labels.tolist().index(g) for g in range(G)] == refs.tolist()  # first appearance order
    score = 0
    for g in range(G):
        members = np.flatnonzero(labels == g)
        P = prefix[g]
        assert P >= 1 and (cap[members] >= P).all()
        assert (bt[members, :P] == bt[refs[g], :P]).all()
        score += (len(members) - 1) * P
    coarse = 0
    for b0 in set(bt[:, 0].tolist()):
        m = np.flatnonzero(bt[:, 0] == b0)
        coarse += (len(m) - 1) * common_prefix_blocks(bt[m], cap[m])
    assert score >= coarse
