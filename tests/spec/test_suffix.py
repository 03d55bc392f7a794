"""Suffix decoding (``method="suffix"``): drafts from earlier responses and the request's own
tokens, by the rules of ``spec/suffix.py``; through the engine, a workload asked twice has its
second answers drafted from the first, and the tokens are the plain engine's."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from ray_attn.engine import SamplingParams
from ray_attn.spec.suffix import SuffixProposer
from ray_attn.spec_config import SpeculativeConfig
from tests.spec.test_spec_engine import engine, prompts, tokens

SUFFIX = dict(method="suffix", num_speculative_tokens=4, disable_by_batch_size=None)


def arr(*t):
    return np.array(t, np.int32)


def test_a_response_seen_before_is_continued():
    p = SuffixProposer(4)
    p.add_response([1, 2, 3, 4, 5, 6, 7, 8, 9])
    # the request ends with 2 3 4 5: 4 matched tokens, so up to 4 drafts -- what followed
    assert p.propose(arr(50, 2, 3, 4, 5)).tolist() == [6, 7, 8, 9]
    assert p.propose(arr(50, 2, 3, 4, 5), k=2).tolist() == [6, 7]
    assert p.propose(arr(50, 60, 70)).tolist() == []  # its last 3 tokens occur nowhere


def test_the_spec_factor_bounds_drafts_by_the_match_length():
    p = SuffixProposer(8, spec_factor=1.0)
    p.add_response(list(range(10, 30)))
    assert len(p.propose(arr(1, 2, 12, 13, 14))) == 3  # 3 tokens matched: 3 drafts
    assert len(p.propose(arr(10, 11, 12, 13, 14))) == 5
    assert len(SuffixProposer(8, spec_factor=0.5).propose(arr(0))) == 0


def test_the_most_frequent_continuation_and_the_min_token_prob():
    p = SuffixProposer(4, min_prob=0.5)
    for tail in ([7, 8, 9, 1], [7, 8, 9, 2], [7, 8, 9, 3], [7, 5, 5, 5]):
        p.add_response([1, 2, 3, 4, *tail])
    # after 1 2 3 4: 7 in 3 of 4 occurrences, then 8 and 9 in all 3, then 1 / 2 / 3 a third each
    assert p.propose(arr(1, 2, 3, 4)).tolist() == [7, 8, 9]
    assert SuffixProposer(4, min_prob=0.9).propose(arr(1, 2, 3, 4)).tolist() == []


def test_the_longest_match_wins_and_the_requests_own_tokens_count():
    p = SuffixProposer(3)
    p.add_response([9, 1, 2, 3, 40, 41, 42])  # matches 1 2 3 only
    p.add_response([8, 8, 1, 2, 3, 50, 51, 52])  # matches 8 1 2 3
    assert p.propose(arr(8, 1, 2, 3)).tolist() == [50, 51, 52]
    own = arr(5, 6, 7, 30, 31, 32, 33, 5, 6, 7)  # its own earlier 5 6 7 is followed by 30 31 32
    assert SuffixProposer(3).propose(own).tolist() == [30, 31, 32]


def test_the_oldest_responses_are_dropped():
    p = SuffixProposer(2, max_cached=2)
    for r in ([1, 2, 3, 10, 11], [4, 5, 6, 12, 13], [7, 8, 9, 14, 15]):
        p.add_response(r)
    assert p.propose(arr(1, 2, 3)).tolist() == []  # evicted: its occurrences are skipped
    assert p.propose(arr(7, 8, 9)).tolist() == [14, 15]
    # the index is rebuilt once mostly stale: it holds the kept responses' occurrences and no more
    for i in range(200):
        p.add_response([i, i + 1, i + 2, i + 3, i + 4])
    entries = [c >> 32 for lst in p.index.values() for c in lst]
    assert len(entries) <= (64 + 3) * 3 and set(p.responses) <= set(entries)
    assert p.propose(arr(199, 200, 201)).tolist() == [202, 203]


def test_config_defaults_and_refusals():
    s = SpeculativeConfig(**SUFFIX)
    assert s.suffix_params == dict(max_depth=24, max_cached=1000, spec_factor=1.0, min_prob=0.1)
    for bad, match in ((dict(suffix_decoding_min_token_prob=1.5), "min_token_prob"),
                       (dict(prompt_lookup_max=3), "prompt_lookup_max is not for method='suffix'")):
        with pytest.raises(ValidationError, match=match):
            SpeculativeConfig(**SUFFIX, **bad)
    with pytest.raises(ValidationError, match="suffix_decoding_max_tree_depth is for method='suffix'"):
        SpeculativeConfig(num_speculative_tokens=2, suffix_decoding_max_tree_depth=8)


def test_a_workload_asked_again_is_drafted_from_the_first_answers():
    plain, eng = engine(None), engine(SUFFIX)
    ps = prompts(0, 6, seed=9)  # random prompts: the first pass finds little to draft from
    params = SamplingParams(max_tokens=24)
    want = tokens(plain.generate(ps, params))
    assert tokens(eng.generate(ps, params)) == want
    first = eng.spec.stats.num_accepted_tokens
    assert tokens(eng.generate(ps, params)) == want  # again: the cached answers are the drafts
    s = eng.spec.stats
    assert s.num_accepted_tokens - first > 50, s
    assert len(eng.spec.proposer.responses) == 12
