"""Logprobs as the OpenAI endpoints return them: each token's text resolved (``token_id:N``
without a tokenizer), floored at vLLM's -9999 (JSON has no -inf), and vLLM's ``prompt_logprobs``
shape.  ``c`` is a ``serving.Choice``: its ``detok``, ``prompt_ids`` and ``prompt_logprobs``.

Completions' ``text_offset`` is counted as vLLM counts it (``_create_completion_logprobs``): the
first entry at 0, each next one at the previous one's offset plus the length of the previous
token's string.  The token strings are each token decoded on its own, so a token that ends inside
a multi-byte character counts its U+FFFD: the offsets add up over ``tokens``, not over the
decoded text (which holds one character where its two byte tokens show two U+FFFD)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


def token_text(c, token_id: int) -> str:
    return c.detok.token_text(token_id) if c.detok is not None else f"token_id:{token_id}"


MIN_LOGPROB = -9999.0  # vLLM's floor: JSON has no -inf


@dataclass
class LogprobEntry:
    """A token's logprobs with the token texts resolved (``token_id:N`` without a tokenizer).
    An echoed prompt's first token has none: ``logprob`` and ``top`` are None."""

    token: str
    logprob: Optional[float]
    offset: int  # the sum of the lengths of the token strings before it (vLLM's text_offset)
    top: Optional[list[tuple[str, float]]]


def logprob_entry(c, lp, offset: int) -> LogprobEntry:
    """A ``TokenLogprobs`` with its texts, floored at ``MIN_LOGPROB``."""
    text = token_text
    return LogprobEntry(text(c, lp.token_id), max(lp.logprob, MIN_LOGPROB), offset,
                        [(text(c, i), max(v, MIN_LOGPROB)) for i, v in lp.top])


def prompt_entries(c) -> list[LogprobEntry]:
    """The prompt's tokens as logprob entries (completions' ``echo``), the first without
    logprobs; the first at 0, each next one past the previous token's string."""
    out, offset = [], 0
    lps = c.prompt_logprobs or [None] * len(c.prompt_ids)
    for t, lp in zip(c.prompt_ids, lps):
        e = (LogprobEntry(token_text(c, t), None, offset, None) if lp is None
             else logprob_entry(c, lp, offset))
        out.append(e)
        offset += len(e.token)
    return out


def token_chars(c, token_ids) -> int:
    """The lengths of the tokens' strings, summed: where the entry after them starts."""
    return sum(len(token_text(c, t)) for t in token_ids)


def prompt_logprobs_json(c) -> Optional[list]:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} holding the prompt's own token and the top k there."""
    if c.prompt_logprobs is None:
        return None
    text = token_text

    def one(i, v, rank):
        return {"logprob": max(v, MIN_LOGPROB), "rank": rank, "decoded_token": text(c, i)}

    out = []
    for lp in c.prompt_logprobs:
        if lp is None:
            out.append(None)
            continue
        d = {str(lp.token_id): one(lp.token_id, lp.logprob, lp.rank)}
        for rank, (i, v) in enumerate(lp.top, 1):
            d.setdefault(str(i), one(i, v, rank))
        out.append(d)
    return out
