"""Completions ``logprobs.text_offset`` as vLLM counts it (``serving_completion.py``
``_create_completion_logprobs``): the first entry at 0, each next one at the previous offset plus
the length of the previous token's string -- over the echoed prompt's entries and on into the
output's.  Checked on output and prompts full of characters that tokens split (byte-level BPE),
where the token strings (one U+FFFD per byte fragment) do not add up to the text; streamed and
whole, echoed and not, resumed.  No Serve instance: the handler runs in process
(``openai_harness``) against an engine loop that streams the given ids."""

from __future__ import annotations

import numpy as np
import pytest

from ray_attn.serve.openai.completions import create_completion
from ray_attn.serve.resume import ChoiceProgress, Resume
from tests.serve.openai_harness import Script, ScriptedLoop, answer, server, streamed_logprobs, streamed_text
from tests.tokenizer_fixture import build_tokenizer

PROMPT = "café 日本語 🚀✨"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tok")
    build_tokenizer(folder, 512)
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def check_offsets(lp: dict) -> None:
    """vLLM's count: offsets[0] == 0 and offsets[i + 1] == offsets[i] + len(tokens[i])."""
    offs, toks = lp["text_offset"], lp["tokens"]
    assert len(offs) == len(toks)
    assert offs[:1] in ([], [0]), offs
    for i in range(len(toks) - 1):
        assert offs[i + 1] == offs[i] + len(toks[i]), (i, list(zip(toks, offs)))


def multibyte_ids(tok, rng, n: int) -> list[int]:
    """Random ids weighted to the byte tokens of multi-byte characters (and some of any kind)."""
    vocab = list(range(3, len(tok)))
    split = [i for i in vocab if "\ufffd" in tok.decode([i])]
    assert split, "the tokenizer has byte-fragment tokens"
    return [int(rng.choice(split)) if rng.random() < 0.5 else int(rng.choice(vocab)) for _ in range(n)]


def complete(tok, output, chunk=1, resume=None, tokenizer=True, **body):
    srv = server(tok if tokenizer else None, ScriptedLoop([Script(output)], chunk))
    body = dict(dict(prompt=PROMPT, max_tokens=max(len(output), 1), logprobs=1), **body)
    return answer(create_completion, srv, body, resume)


@pytest.mark.parametrize("echo", [False, True])
@pytest.mark.parametrize("chunk", [1, 3])
def test_offsets_add_up_over_the_token_strings(tok, echo, chunk):
    """Streamed (one or three tokens per engine event) and whole: the streamed chunks' entries,
    put together, are the whole answer's, and both follow vLLM's count."""
    rng = np.random.default_rng(chunk)
    prompt_ids = tok(PROMPT)["input_ids"]
    uneven = 0
    for _ in range(12):
        ids = multibyte_ids(tok, rng, int(rng.integers(4, 20)))
        whole = complete(tok, ids, chunk, echo=echo)["choices"][0]
        lp = whole["logprobs"]
        shown = (prompt_ids if echo else []) + ids
        assert lp["tokens"] == [tok.decode([t]) for t in shown]
        assert whole["text"] == (PROMPT if echo else "") + tok.decode(ids)
        check_offsets(lp)
        uneven += sum(map(len, lp["tokens"])) != len(whole["text"])
        events = complete(tok, ids, chunk, echo=echo, stream=True)
        assert events[-1] == "[DONE]"
        streamed = streamed_logprobs(events)
        assert streamed_text(events) == whole["text"]
        assert streamed["tokens"] == lp["tokens"] and streamed["text_offset"] == lp["text_offset"]
    assert uneven, "some output where the token strings do not add up to the text"


def test_offsets_of_the_issue_shape(tok):
    """The issue's shape: '0', a byte token that never makes a character, 'E'; and '0', the two
    byte tokens of one character, 'E'.  Each U+FFFD counts one: [0, 1, 2] and [0, 1, 2, 3]
    (the old count, into the text, said [0, 1, 1, 2] for the second: '日' is one character)."""
    split = [ch for ch in "日本語のテキストと絵文字🚀✨" if len(tok(ch)["input_ids"]) == 2
             and all("\ufffd" in tok.decode([i]) for i in tok(ch)["input_ids"])]
    assert split, "some character is two byte tokens in this vocabulary"
    lead, tail = tok(split[0])["input_ids"]
    zero, e = tok("0")["input_ids"], tok("E")["input_ids"]
    for stream in (False, True):
        out = complete(tok, zero + [lead] + e, stream=stream)
        lp = streamed_logprobs(out) if stream else out["choices"][0]["logprobs"]
        assert lp["tokens"] == ["0", "\ufffd", "E"] and lp["text_offset"] == [0, 1, 2]
        out = complete(tok, zero + [lead, tail] + e, stream=stream)
        lp = streamed_logprobs(out) if stream else out["choices"][0]["logprobs"]
        assert lp["tokens"] == ["0", "\ufffd", "\ufffd", "E"] and lp["text_offset"] == [0, 1, 2, 3]


def test_echoed_prompt_offsets_run_on_into_the_output(tok):
    """With echo the prompt's entries start at 0 and the output's first entry is where the
    prompt's token strings end -- not the echoed text's length, which is shorter here."""
    prompt_ids = tok(PROMPT)["input_ids"]
    strings = [tok.decode([t]) for t in prompt_ids]
    assert sum(map(len, strings)) > len(PROMPT), "the prompt has split characters"
    ids = tok(" the quick")["input_ids"]
    for stream in (False, True):
        out = complete(tok, ids, echo=True, stream=stream)
        lp = streamed_logprobs(out) if stream else out["choices"][0]["logprobs"]
        n = len(prompt_ids)
        assert lp["text_offset"][:n] == list(np.cumsum([0] + [len(s) for s in strings[:-1]]))
        assert lp["text_offset"][n] == sum(map(len, strings))
        check_offsets(lp)


def test_offsets_with_a_stop_string(tok):
    """A stop string ends the text inside a token: the entries still count the token strings."""
    rng = np.random.default_rng(1)
    for _ in range(8):
        ids = tok("hello world, hello ray")["input_ids"] + multibyte_ids(tok, rng, 6)
        for stream in (False, True):
            out = complete(tok, ids, 2, stop=["o r"], stream=stream)
            text = streamed_text(out) if stream else out["choices"][0]["text"]
            lp = streamed_logprobs(out) if stream else out["choices"][0]["logprobs"]
            assert text == "hello world, hell"
            assert "".join(lp["tokens"]).startswith("hello world, hello r")
            check_offsets(lp)


def test_offsets_without_a_tokenizer(tok):
    """No tokenizer: tokens are ``token_id:N`` (vLLM's return_tokens_as_token_ids) and count so."""
    ids = [5, 17, 300, 2]
    for echo in (False, True):
        out = complete(tok, ids, tokenizer=False, prompt=[9, 10, 11], echo=echo, max_tokens=4)
        lp = out["choices"][0]["logprobs"]
        assert lp["tokens"] == [f"token_id:{t}" for t in ([9, 10, 11] if echo else []) + ids]
        check_offsets(lp)


@pytest.mark.parametrize("echo", [False, True])
def test_a_resumed_stream_goes_on_counting_where_the_lost_one_stopped(tok, echo):
    """A stream resumed on another replica after k tokens: its entries carry on the lost
    stream's count, so what the client gets adds up to the whole answer's offsets."""
    rng = np.random.default_rng(7)
    ids = multibyte_ids(tok, rng, 12)
    whole = complete(tok, ids, echo=echo)["choices"][0]["logprobs"]
    n_prompt = len(tok(PROMPT)["input_ids"]) if echo else 0
    for k in (1, 5, 11):
        resume = Resume({"id": "cmpl-x", "created": 1}, {0: ChoiceProgress(ids[:k])}).to_json()
        rest = streamed_logprobs(complete(tok, ids, echo=echo, stream=True, resume=resume))
        assert rest["tokens"] == whole["tokens"][n_prompt + k:]
        assert rest["text_offset"] == whole["text_offset"][n_prompt + k:], k
