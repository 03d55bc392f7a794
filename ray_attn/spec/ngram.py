"""Prompt lookup (vLLM's ``NgramProposer``): the draft of a request is what followed the earliest
earlier occurrence of its longest matching suffix n-gram, in its own prompt and output.

For an "edit this text" request the output repeats the prompt, so its last few tokens almost
always occur in the prompt and the tokens after them are the next ones; in free text matches are
rare and short, and the proposer then proposes nothing (the request decodes as usual).

vLLM finds the match with a KMP pass over the reversed tokens in a numba loop; here it is numpy
over the candidates: one comparison of every earlier token with the last one, then, for the few
positions that match, one more comparison per n-gram length -- ``prompt_lookup_max`` vectorised
passes, the later ones over a handful of candidates.  The choice is vLLM's: the longest n-gram
(at most ``prompt_lookup_max``, at least ``prompt_lookup_min``), and among equally long ones the
earliest occurrence.
"""

from __future__ import annotations

import numpy as np


def propose_ngram(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """Up to ``k`` draft tokens for a request whose tokens so far are ``tokens`` (1-D ints): the
    tokens after the earliest earlier occurrence of its longest suffix of ``min_n..max_n`` tokens;
    empty when no suffix of ``min_n`` tokens occurred before (or ``k`` <= 0)."""
    N = len(tokens)
    if k <= 0 or N < min_n + 1:
        return tokens[:0]
    # ends: where an occurrence of the suffix's last token ends, strictly before the suffix itself
    ends = np.flatnonzero(tokens[:N - 1] == tokens[N - 1])
    length = 1
    while len(ends) and length < max_n:
        back = ends - length
        ok = back >= 0
        ok[ok] = tokens[back[ok]] == tokens[N - 1 - length]
        if length + 1 > min_n and not ok.any():
            break  # the longest match is ``length``: keep ``ends`` as they are
        if not ok.any():
            return tokens[:0]  # nothing reaches min_n
        ends, length = ends[ok], length + 1
    if not len(ends) or length < min_n:
        return tokens[:0]
    start = int(ends[0]) + 1  # the earliest occurrence, as vLLM picks
    return tokens[start:start + k]


class NgramProposer:
    """Drafts for one request at a time, from its token history (prompt + output)."""

    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int):
        self.k, self.min_n, self.max_n = num_speculative_tokens, min_n, max_n

    def propose(self, tokens: np.ndarray, k: int | None = None) -> np.ndarray:
        """At most ``k`` (default: ``num_speculative_tokens``) draft tokens after ``tokens``."""
        return propose_ngram(tokens, self.k if k is None else min(k, self.k), self.min_n, self.max_n)
