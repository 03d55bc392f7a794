"""Completions ``logprobs.text_offset`` against the returned text, on output full of characters
that tokens split (byte-level BPE): no Serve instance, the OpenAI layer's ChoiceSet fed events."""

from __future__ import annotations

import numpy as np
import pytest

from ray_attn.detokenizer import IncrementalDetokenizer
from ray_attn.request import SamplingParams, TokenLogprobs
from ray_attn.serve.loop import Event
from ray_attn.serve.openai.completions import _logprobs
from ray_attn.serve.openai.serving import Choice, ChoiceSet
from tests.tokenizer_fixture import build_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tok")
    build_tokenizer(folder, 512)
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


class _Loop:
    def abort(self, rid):
        pass


def _run(tok, ids, chunk, stop=()):
    detok = IncrementalDetokenizer(tok, [], stop, track_offsets=True)
    c = Choice(0, 0, [5], SamplingParams(max_tokens=len(ids), logprobs=0), detok, rid="r")
    cs = ChoiceSet(_Loop(), [c], 1)
    for i in range(0, len(ids), chunk):
        part = ids[i:i + chunk]
        last = i + chunk >= len(ids)
        cs._advance(c, Event("tokens", part, last, "length" if last else None, None,
                             [TokenLogprobs(t, -1.0, 1, []) for t in part]))
        if c.done:
            break
    return c.text, _logprobs(c.logprobs)


def _multibyte_ids(tok, rng, n):
    """Random ids weighted to the byte tokens of multi-byte characters (and some ASCII)."""
    vocab = [i for i in range(3, len(tok))]
    split = [i for i in vocab if "\ufffd" in tok.decode([i])]
    assert split, "the tokenizer has byte-fragment tokens"
    return [int(rng.choice(split)) if rng.random() < 0.5 else int(rng.choice(vocab)) for _ in range(n)]


def check_offsets(text, lp):
    offs, toks = lp["text_offset"], lp["tokens"]
    assert len(offs) == len(toks)
    assert offs == sorted(offs), "offsets never go back"
    assert all(0 <= o <= len(text) for o in offs)
    for o, t in zip(offs, toks):
        if t and "\ufffd" not in t:  # a whole piece of its own: it is in the text where it says
            # (or it is the last piece, cut short by a stop string)
            assert text[o:].startswith(t) or t.startswith(text[o:]), (text, offs, toks)


@pytest.mark.parametrize("chunk", [1, 3])
def test_text_offset_matches_the_text_on_multibyte_output(tok, chunk):
    rng = np.random.default_rng(0)
    for _ in range(40):
        ids = _multibyte_ids(tok, rng, int(rng.integers(4, 24)))
        text, lp = _run(tok, ids, chunk)
        assert text == tok.decode(ids, skip_special_tokens=True)
        check_offsets(text, lp)


def test_text_offset_of_the_issue_shape(tok):
    """The issue's shape: '0', byte tokens that never make a character (shown as U+FFFD once the
    next token comes), then 'E'.  'E' is at 2, where the old code said 1 (the length of the text
    before it, while the bytes were still held).  A character whose bytes do complete is fine
    either way."""
    split = [ch for ch in "日本語のテキストと絵文字🚀✨" if len(tok(ch)["input_ids"]) == 2
             and all("\ufffd" in tok.decode([i]) for i in tok(ch)["input_ids"])]
    assert split, "some character is two byte tokens in this vocabulary"
    lead, tail = tok(split[0])["input_ids"]
    zero, e = tok("0")["input_ids"], tok("E")["input_ids"]
    text, lp = _run(tok, zero + [lead] + e, 1)
    assert text == "0\ufffdE" and lp["text_offset"] == [0, 1, 2]
    text, lp = _run(tok, zero + [lead, tail] + e, 1)
    assert text == "0" + split[0] + "E" and lp["text_offset"] == [0, 1, 1, 2]


def test_text_offset_with_a_stop_string(tok):
    rng = np.random.default_rng(1)
    for _ in range(20):
        ids = tok("hello world, hello ray")["input_ids"] + _multibyte_ids(tok, rng, 6)
        text, lp = _run(tok, ids, 2, stop=["o r"])
        assert text == "hello world, hell"
        check_offsets(text, lp)
