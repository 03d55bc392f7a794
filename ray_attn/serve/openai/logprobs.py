"""Logprobs as the OpenAI endpoints return them: each token's text resolved (``token_id:N``
without a tokenizer), floored at vLLM's -9999 (JSON has no -inf), and vLLM's ``prompt_logprobs``
shape.  ``c`` is a ``serving.Choice``: its ``detok``, ``prompt_ids`` and ``prompt_logprobs``."""

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
    offset: int  # where the token's text starts in the choice's text
    top: Optional[list[tuple[str, float]]]


def logprob_entry(c, lp, offset: int) -> LogprobEntry:
    """A ``TokenLogprobs`` with its texts, floored at ``MIN_LOGPROB``."""
    text = token_text
    return LogprobEntry(text(c, lp.token_id), max(lp.logprob, MIN_LOGPROB), offset,
                        [(text(c, i), max(v, MIN_LOGPROB)) for i, v in lp.top])


def prompt_entries(c, offsets: Optional[list[int]] = None) -> list[LogprobEntry]:
    """The prompt's tokens as logprob entries (completions' ``echo``), the first without
    logprobs; at ``offsets`` in the echoed text, or else each at the sum of the token texts
    before it (vLLM's count; without a tokenizer there is no text to point into)."""
    out, offset = [], 0
    lps = c.prompt_logprobs or [None] * len(c.prompt_ids)
    for i, (t, lp) in enumerate(zip(c.prompt_ids, lps)):
        at = offset if offsets is None else offsets[i]
        e = (LogprobEntry(token_text(c, t), None, at, None) if lp is None
             else logprob_entry(c, lp, at))
        out.append(e)
        offset += len(e.token)
    return out


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
