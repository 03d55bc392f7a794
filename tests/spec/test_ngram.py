"""Prompt lookup (ray_attn/spec/ngram.py) against vLLM's own n-gram search, written out below as
vLLM has it (KMP over the reversed tokens, ``_find_longest_matched_ngram_and_propose_tokens``)."""

from __future__ import annotations

import numpy as np
import pytest

from ray_attn.spec.ngram import NgramProposer, propose_ngram


def vllm_reference(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """vLLM v1's ngram_proposer.py function, less its max_model_len cap (the engine caps k)."""
    total = tokens.shape[0]
    if total < min_n or k <= 0:
        return tokens[:0]
    rev = tokens[::-1]
    lps = np.zeros(max_n, dtype=np.int32)
    longest, position, prev, i = 0, 0, 0, 1
    while i < total:
        if rev[prev] == rev[i]:
            prev += 1
            if prev >= longest:
                longest, position = prev, i
            if i < max_n:
                lps[i] = prev
            if prev == max_n:
                prev = lps[max_n - 1]
            i += 1
        elif prev != 0:
            prev = lps[prev - 1]
        else:
            i += 1
    if longest < min_n:
        return tokens[:0]
    start = total - 1 - position + longest
    return tokens[start:start + min(k, total - start)]


@pytest.mark.parametrize("vocab", [2, 3, 8, 50])
def test_matches_vllms_search(vocab):
    rng = np.random.default_rng(vocab)
    checked = proposed = 0
    for _ in range(400):
        n = int(rng.integers(1, 80))
        toks = rng.integers(0, vocab, n).astype(np.int32)
        lo = int(rng.integers(1, 5))
        hi = int(rng.integers(lo, 7))
        k = int(rng.integers(0, 6))
        want = vllm_reference(toks, lo, hi, k)
        assert propose_ngram(toks, k, lo, hi).tolist() == want.tolist(), (toks.tolist(), lo, hi, k)
        checked += 1
        proposed += len(want) > 0
    assert proposed > checked // 10  # the cases must include matches, not only empty drafts


def test_the_longest_ngram_wins_and_then_the_earliest_occurrence():
    toks = np.array([9, 1, 2, 3, 7, 7, 2, 3, 8, 8, 1, 2, 3], np.int32)
    # suffix 1 2 3 (n=3) occurs at 1..3, followed by 7 7; the bigram 2 3 also at 6..7 (then 8)
    assert propose_ngram(toks, 2, 2, 4).tolist() == [7, 7]
    assert propose_ngram(toks, 4, 4, 4).tolist() == []  # 9 1 2 3 / 3 1 2 3: no 4-gram matches
    assert NgramProposer(3, 1, 2).propose(toks, 8).tolist() == [7, 7, 2]  # the bigram's earliest: 2 3 at 2..3
