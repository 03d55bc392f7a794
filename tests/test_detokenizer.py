"""The incremental detokenizer against the tokenizer's own whole-sequence decode, and stop strings
found in text that tokens split."""

from __future__ import annotations

import numpy as np
import pytest

from ray_attn.detokenizer import IncrementalDetokenizer
from tests.tokenizer_fixture import CORPUS, build_tokenizer

TEXTS = sorted(set(CORPUS)) + ["hello 日本語 🚀 café, the lazy dog naïve"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tok")
    build_tokenizer(folder, 512)
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def stream(tok, prompt, ids, chunk=1, **kw):
    d = IncrementalDetokenizer(tok, prompt, **kw)
    pieces = []
    for i in range(0, len(ids), chunk):
        d.add(ids[i:i + chunk])
        pieces.append(d.take())
        if d.stopped:
            break
    d.finish()
    pieces.append(d.take(final=True))
    return d, pieces


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_is_the_whole_decode(tok, text, chunk):
    ids = tok(text)["input_ids"]
    prompt = tok("A prompt before it: ")["input_ids"]
    d, pieces = stream(tok, prompt, ids, chunk)
    assert "".join(pieces) == d.text == tok.decode(ids, skip_special_tokens=True)
    # a character split over two tokens is never shown half-made
    assert all("\ufffd" not in p for p in pieces)


def test_random_ids_decode_like_the_whole(tok):
    rng = np.random.default_rng(0)
    for _ in range(50):
        ids = rng.integers(0, len(tok), int(rng.integers(1, 40))).tolist()
        d, pieces = stream(tok, [], ids)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)


def test_special_tokens_skipped_or_kept(tok):
    ids = tok("hello world")["input_ids"] + [2] + tok(" again")["input_ids"]
    d, _ = stream(tok, [], ids)
    assert d.text == "hello world again"
    d, _ = stream(tok, [], ids, skip_special_tokens=False)
    assert d.text == "hello world<|im_end|> again"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tok, include):
    text = "hello world, hello ray, hello attention"
    ids = tok(text)["input_ids"]
    stop = "o r"  # spans the end of one token and the start of another
    d, pieces = stream(tok, [], ids, stop=["zzz", stop], include_stop_str_in_output=include)
    cut = text.index(stop)
    assert d.stop_reason == stop
    assert d.text == text[:cut + (len(stop) if include else 0)] == "".join(pieces)
    # it stopped at the token that completed the string, not later
    assert tok.decode(ids[:d.num_tokens - 1]).find(stop) < 0 <= tok.decode(ids[:d.num_tokens]).find(stop)


def test_stream_holds_back_a_possible_stop_string(tok):
    text = "hello world, hello ray"
    ids = tok(text)["input_ids"]
    d = IncrementalDetokenizer(tok, [], stop=["world peace"])
    shown = ""
    for t in ids:
        d.add([t])
        shown += d.take()
        assert len(d.text) - len(shown) <= len("world peace") - 1
        assert not shown.endswith("worl")  # never the start of the stop string while it may complete
    d.finish()
    assert shown + d.take(final=True) == text and not d.stopped


def test_earliest_stop_wins(tok):
    text = "the quick brown fox jumps over the lazy dog"
    d, _ = stream(tok, [], tok(text)["input_ids"], chunk=50, stop=["lazy", "brown"])
    assert d.stop_reason == "brown" and d.text == "the quick "
