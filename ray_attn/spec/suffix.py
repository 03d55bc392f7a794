"""Suffix decoding (vLLM's ``method="suffix"``, from Arctic Inference): drafts from the responses
the engine already gave, as well as from the request's own prompt and output.

Agentic and repetitive workloads ask the same things again (a tool call re-planned, a file
rewritten, a question retried): the answer to come often repeats one given before.  The
proposer keeps the last ``suffix_decoding_max_cached_requests`` responses (1,000 by default where
vLLM keeps 10,000: see ``spec_config.SUFFIX_DEFAULTS``) and, for a decoding
request, finds where its last tokens occurred before -- in those responses and in its own
tokens -- and continues from there:

- Candidates: every earlier occurrence of the request's last ``ANCHOR`` tokens, found through an
  index of the responses' ``ANCHOR``-grams (its own tokens are searched directly).  Each is
  extended backwards to its match length, at most ``suffix_decoding_max_tree_depth``; the
  longest matches are kept.
- Drafts: token by token, the continuation most of the remaining candidates take, while that
  share is at least ``suffix_decoding_min_token_prob`` -- the candidates that take another token
  drop out.  At most ``num_speculative_tokens`` and ``suffix_decoding_max_spec_factor`` times the
  match length, as vLLM bounds them.

Where vLLM keeps suffix trees (C++), this keeps an n-gram index (Python, numpy for the request's
own tokens): the drafts follow the same rules, the frequencies are counted over the matched
occurrences instead of read off tree nodes.  Drafts are a point mass, verified exactly like
n-gram drafts (``runtime/spec_decode.py``), so the output never depends on them.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict

import numpy as np

ANCHOR = 3  # tokens an occurrence must share with the request's end to be a candidate
MAX_CANDIDATES = 64  # the most recent occurrences of an anchor looked at
# An anchor keeps at most this many occurrences (the oldest go first), and evicted responses
# leave theirs behind until the index is rebuilt: an eviction then costs nothing per anchor,
# however common its anchors are, and the index stays within a few times the cache.
MAX_PER_ANCHOR = 4 * MAX_CANDIDATES


def _keys(toks: np.ndarray) -> list[int]:
    """One int per ``ANCHOR`` consecutive tokens (ids below 2**21): the anchors of ``toks``, the
    one ending before ``toks[ANCHOR]`` first, then one per token after (the last ends at its end)."""
    t = np.asarray(toks, np.int64)
    key = t[:len(t) - ANCHOR + 1].copy()
    for j in range(1, ANCHOR):
        key = (key << 21) | t[j:len(t) - ANCHOR + 1 + j]
    return key.tolist()


class SuffixProposer:
    def __init__(self, num_speculative_tokens: int, max_depth: int = 24, max_cached: int = 1000,
                 spec_factor: float = 1.0, min_prob: float = 0.1):
        self.k, self.max_depth, self.max_cached = num_speculative_tokens, max_depth, max_cached
        self.spec_factor, self.min_prob = spec_factor, min_prob
        self.responses: OrderedDict[int, np.ndarray] = OrderedDict()  # oldest first
        # anchor key -> occurrences as response id << 32 | end; with the dict's own entries, about
        # 190 bytes a cached token (most anchors of 3 tokens occur once)
        self.index: dict[int, list[int]] = defaultdict(list)
        self._next_id = 0
        self._evicted = 0  # responses dropped since the index was last rebuilt

    # -- the cache of responses ---------------------------------------------------------------
    def add_response(self, tokens) -> None:
        """Remember a finished request's prompt tail and output (``tokens``) for later drafts."""
        toks = np.asarray(tokens, np.int32)
        if len(toks) <= ANCHOR or self.max_cached == 0:
            return
        rid, self._next_id = self._next_id, self._next_id + 1
        self.responses[rid] = toks
        self._index(rid, toks)
        while len(self.responses) > self.max_cached:
            self.responses.popitem(last=False)
            self._evicted += 1
        if self._evicted > max(64, len(self.responses)):  # mostly stale: rebuild from what is kept
            self.index.clear()
            self._evicted = 0
            for r, t in self.responses.items():
                self._index(r, t)

    def _index(self, rid: int, toks: np.ndarray) -> None:
        for end, key in enumerate(_keys(toks), start=ANCHOR):  # the anchor before toks[end]
            bucket = self.index[key]
            bucket.append(rid << 32 | end)
            if len(bucket) > 2 * MAX_PER_ANCHOR:
                del bucket[:MAX_PER_ANCHOR]

    # -- drafts -------------------------------------------------------------------------------
    def propose(self, tokens: np.ndarray, k: int | None = None) -> np.ndarray:
        """At most ``k`` (default: ``num_speculative_tokens``) draft tokens after ``tokens``."""
        k = self.k if k is None else min(k, self.k)
        N = len(tokens)
        if k <= 0 or N < ANCHOR:
            return tokens[:0]
        seqs = [(tokens, end) for end in self._own_ends(tokens)]
        recent = self.index.get(_keys(tokens[N - ANCHOR:])[0], ())[-2 * MAX_CANDIDATES:]
        live = [(self.responses[c >> 32], c & 0xFFFFFFFF) for c in recent if c >> 32 in self.responses]
        seqs += live[-MAX_CANDIDATES:]
        if not seqs:
            return tokens[:0]
        # the match length of each occurrence, at most max_depth; keep the longest ones
        lengths = [self._match(tokens, seq, end) for seq, end in seqs]
        best = max(lengths)
        cands = [(seq, end) for (seq, end), n in zip(seqs, lengths) if n == best]
        limit = min(k, int(self.spec_factor * best))
        out = []
        while len(out) < limit and cands:
            nxt = defaultdict(list)
            for seq, end in cands:
                if end < len(seq):
                    nxt[int(seq[end])].append((seq, end + 1))
            if not nxt:
                break
            token, followers = max(nxt.items(), key=lambda kv: len(kv[1]))
            if len(followers) < self.min_prob * len(cands):
                break
            out.append(token)
            cands = followers
        return np.asarray(out, dtype=tokens.dtype)

    def _own_ends(self, tokens: np.ndarray) -> list[int]:
        """Where the request's last ``ANCHOR`` tokens occurred earlier in its own tokens (the
        position after each occurrence), the latest last."""
        N = len(tokens)
        tail = tokens[N - ANCHOR:]
        ends = np.flatnonzero(tokens[ANCHOR - 1:N - 1] == tail[-1]) + ANCHOR  # candidate ends < N
        for j in range(1, ANCHOR):
            if not len(ends):
                break
            ends = ends[tokens[ends - 1 - j] == tail[-1 - j]]
        return ends[-MAX_CANDIDATES:].tolist()

    def _match(self, tokens: np.ndarray, seq: np.ndarray, end: int) -> int:
        """How many tokens before ``seq[end]`` equal the request's last ones (at most max_depth)."""
        n = min(self.max_depth, end, len(tokens))
        a, b = tokens[len(tokens) - n:][::-1], seq[end - n:end][::-1]
        diff = np.flatnonzero(a != b)
        return int(diff[0]) if len(diff) else n
