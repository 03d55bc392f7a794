"""Token ids to text while they stream, and stop strings found in that text.

The engine works in token ids only; a server with a tokenizer turns each request's new ids into
text here.  Decoding every token on its own is wrong for byte-level BPE (a character may span two
tokens) and for SentencePiece (a token's leading space depends on what precedes it), and decoding
the whole output every step costs O(length) per token.  So, as vLLM's ``detokenize_incrementally``
does, we decode a short window twice -- with and without the newest tokens -- and release the
difference once it no longer ends in U+FFFD (an incomplete character).

Stop strings are matched in the text, not in tokens: a string can end inside a token, or span
several.  While streaming, the last ``len(longest stop) - 1`` characters are held back, so a
client never sees the beginning of a stop string that then turns out to complete.
"""

from __future__ import annotations

from typing import Sequence

PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded along with the first output tokens (leading spaces)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: Sequence[int] = (), stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        ctx = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._window = ctx  # the prompt's tail, then every output token
        self._prefix_offset, self._read_offset = 0, len(ctx)
        self.stop = tuple(s for s in stop if s)
        self.include_stop = include_stop_str_in_output
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # the output text so far (cut at a stop string once one is found)
        self.num_tokens = 0  # output tokens consumed (up to the one that completed a stop string)
        self.stop_reason: str | None = None  # the stop string found, if any
        self._sent = 0

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: Sequence[int]) -> bool:
        """Consume new output tokens; True once a stop string completed (later ids are ignored)."""
        for t in token_ids:
            if self.stopped:
                break
            self._window.append(int(t))
            self.num_tokens += 1
            before = len(self.text)
            self.text += self._next_piece()
            if self.stop:
                self._find_stop(before)
        return self.stopped

    def _next_piece(self, final: bool = False) -> str:
        """The text the unread tokens add; held back while it ends in an incomplete character,
        unless ``final``."""
        w, p, r = self._window, self._prefix_offset, self._read_offset
        prefix = self._decode(w[p:r])
        full = self._decode(w[p:])
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            self._prefix_offset, self._read_offset = r, len(w)
            return full[len(prefix):]
        return ""

    def _find_stop(self, before: int) -> None:
        # A stop string completed by this token starts at most len(stop) - 1 characters before it.
        hits = []
        for s in self.stop:
            i = self.text.find(s, max(0, before - len(s) + 1))
            if i >= 0:
                hits.append((i, s))
        if hits:
            i, s = min(hits)
            self.text = self.text[: i + len(s) if self.include_stop else i]
            self.stop_reason = s

    def finish(self) -> None:
        """The request ended: release a trailing incomplete character too (as U+FFFD)."""
        if self.stopped:
            return
        before = len(self.text)
        self.text += self._next_piece(final=True)
        if self.stop:
            self._find_stop(before)

    def take(self, final: bool = False) -> str:
        """Text not yet handed out.  Until ``final`` (or a stop), the tail that could still be
        the start of a stop string stays back."""
        end = len(self.text) if final or self.stopped else max(self._sent, len(self.text) - self._hold)
        out, self._sent = self.text[self._sent:end], end
        return out

    def token_text(self, token_id: int) -> str:
        """One token's text on its own, as logprobs report it (special tokens shown)."""
        return self.tokenizer.decode([int(token_id)], skip_special_tokens=False)
