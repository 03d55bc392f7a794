"""The text of ``/v1/generate``'s stream events (``serve/generate.py _sse``) is the same however
the tokens are cut into events: the concatenated texts depend on the tokens only.

Events are cut differently from run to run -- a busy replica coalesces the tokens that are ready,
and a resumed stream starts its new replica's events where the lost one stopped -- so a character
split over two events must not change the text.  (Diffing full decodes broke exactly there: the
first half decoded as U+FFFD, the next decode no longer began with what had been sent, and the
whole text went out again; a loaded run's resume test caught it, 12-02.)  A byte tokenizer stands
in: one token per byte, so a two-byte character spans two tokens."""

from __future__ import annotations

import asyncio
import itertools
import json
from types import SimpleNamespace

import pytest

from ray_attn.serve.generate import _sse
from ray_attn.serve.loop import Event


class ByteTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


TEXT = "aé€b😀c"  # one-, two-, three- and four-byte characters
TOKENS = list(TEXT.encode())


class Sink:
    def __init__(self, chunks):
        self.queue: asyncio.Queue = asyncio.Queue()
        for i, c in enumerate(chunks):
            last = i == len(chunks) - 1
            self.queue.put_nowait(Event("tokens", list(c), finished=last, finish_reason="length" if last else None))

    async def get(self):
        return await self.queue.get()


def streamed_text(chunks, prior=()) -> str:
    server = SimpleNamespace(tokenizer=ByteTokenizer(), loop=SimpleNamespace(abort=lambda rid: None))

    async def run():
        out = []
        async for line in _sse(server, "r", Sink(chunks), "r", list(prior), False):
            if line.startswith("data: {"):
                out.append(json.loads(line[6:])["text"] or "")
        return "".join(out)

    return asyncio.run(run())


def cuts(tokens, points):
    edges = [0, *points, len(tokens)]
    return [tokens[a:b] for a, b in zip(edges, edges[1:])]


@pytest.mark.parametrize("points", [(), (1,), (2,), (1, 2, 3), (5, 9), tuple(range(1, len(TOKENS)))])
def test_text_does_not_depend_on_how_events_are_cut(points):
    assert streamed_text(cuts(TOKENS, points)) == TEXT


@pytest.mark.parametrize("k", range(1, len(TOKENS)))
def test_a_resumed_stream_sends_the_rest_of_the_text_once(k):
    """A new replica replays the first k tokens (``prior``) and sends what follows them; joined to
    what the lost replica sent for those k tokens (its stream cut there), it is the whole text."""
    before = streamed_text([TOKENS[:k]])  # what the lost replica's events carried (that stream ended there)
    sent_before = before.rstrip("\ufffd")  # a stream that went on would have held the split character back
    for points in itertools.islice(itertools.combinations(range(k + 1, len(TOKENS)), 2), 5):
        rest = streamed_text(cuts(TOKENS[k:], [p - k for p in points]), prior=TOKENS[:k])
        assert sent_before + rest == TEXT, (k, points)
