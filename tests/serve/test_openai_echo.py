"""Completions ``echo`` and vLLM's ``prompt_logprobs`` over HTTP against the TP=2 Serve app: the
shapes lm-eval and vLLM clients read, and the numbers against HF's float64 teacher forcing of the
served weights (``helpers.float64_logprobs``).

Tolerance 2e-4 on a logprob: the app runs float32 at TP=2 (the all-reduce's order moves logits by
~1e-6 against TP=1), and the reference float64.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from tests.serve.conftest import MODEL_ID
from tests.serve.helpers import float64_logprobs
from tests.serve.test_openai_offsets import check_offsets
from tests.timescale import scaled

pytestmark = pytest.mark.slow

PROMPT = "the quick brown fox jumps over"
TOL = 2e-4


@pytest.fixture(scope="module")
def tok(served):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(served.tokenizer_dir, local_files_only=True)


def post(served, path, **body) -> httpx.Response:
    return httpx.post(served.url + path, json=dict(model=MODEL_ID, **body), timeout=scaled(120))


def completion(served, **body) -> dict:
    r = post(served, "/v1/completions", **body)
    assert r.status_code == 200, r.text
    return r.json()


def test_lm_eval_loglikelihood_request(served, tok):
    """lm-eval's request (token ids, echo, logprobs=1, max_tokens=1): the prompt's tokens then the
    generated one, the first logprob null, each next one the float64 teacher-forced logprob."""
    ids = tok(PROMPT)["input_ids"]
    out = completion(served, prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0, seed=1234)
    c = out["choices"][0]
    lp = c["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = float64_logprobs(served.args["engine"], ids)
    np.testing.assert_allclose(lp["token_logprobs"][1:len(ids)], ref[np.arange(len(ids) - 1), ids[1:]], atol=TOL)
    for i, top in enumerate(lp["top_logprobs"][1:len(ids)]):
        best = int(np.argmax(ref[i]))
        assert max(top.values()) == pytest.approx(ref[i, best], abs=TOL)  # lm-eval's is_greedy reads this
        assert top[lp["tokens"][i + 1]] == pytest.approx(ref[i, ids[i + 1]], abs=TOL)
    # the generated token is the greedy one after the prompt, and the text is prompt + completion
    gen = lp["tokens"][-1]
    assert lp["token_logprobs"][-1] == pytest.approx(ref[-1].max(), abs=TOL)
    assert c["text"] == tok.decode(ids) + gen and out["usage"]["completion_tokens"] == 1
    check_offsets(lp)


def test_echoed_offsets_count_the_token_strings_on_multibyte_prompts(served):
    prompt = "café naïve résumé — déjà vu 日本語のテキスト 🚀✨"
    c = completion(served, prompt=prompt, echo=True, max_tokens=4, logprobs=0, temperature=0)["choices"][0]
    assert c["text"].startswith(prompt)
    check_offsets(c["logprobs"])


def test_echo_with_max_tokens_zero_is_the_prompt_alone(served, tok):
    out = completion(served, prompt=PROMPT, echo=True, max_tokens=0, logprobs=0)
    c = out["choices"][0]
    n = len(tok(PROMPT)["input_ids"])
    assert c["text"] == PROMPT and c["finish_reason"] == "length"
    assert len(c["logprobs"]["tokens"]) == n and out["usage"]["completion_tokens"] == 0
    bare = completion(served, prompt=PROMPT, echo=True, max_tokens=3, temperature=0)
    plain = completion(served, prompt=PROMPT, max_tokens=3, temperature=0)
    assert bare["choices"][0]["logprobs"] is None
    assert bare["choices"][0]["text"] == PROMPT + plain["choices"][0]["text"]


def test_streamed_echo_equals_the_whole(served):
    body = dict(prompt=[PROMPT, "hello world"], echo=True, logprobs=2, max_tokens=5, temperature=0)
    whole = completion(served, **body)["choices"]
    texts, tokens = ["", ""], [[], []]
    with httpx.stream("POST", served.url + "/v1/completions", json=dict(body, model=MODEL_ID, stream=True),
                      timeout=scaled(120)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    texts[ch["index"]] += ch["text"]
                    tokens[ch["index"]] += ch["logprobs"]["tokens"]
    for i, c in enumerate(whole):
        assert texts[i] == c["text"] and tokens[i] == c["logprobs"]["tokens"]
        assert c["text"].startswith([PROMPT, "hello world"][i])


def test_prompt_logprobs_as_vllm_returns_them(served, tok):
    """``prompt_logprobs=k``: per prompt token None (the first) or {id: {logprob, rank,
    decoded_token}} with the prompt's own token and the top k; on chat, beside the choices."""
    ids = tok(PROMPT)["input_ids"]
    out = completion(served, prompt=PROMPT, max_tokens=2, temperature=0, prompt_logprobs=2)
    plp = out["choices"][0]["prompt_logprobs"]
    ref = float64_logprobs(served.args["engine"], ids)
    assert len(plp) == len(ids) and plp[0] is None
    for j, d in enumerate(plp[1:], 1):
        own = d[str(ids[j])]
        assert own["logprob"] == pytest.approx(ref[j - 1, ids[j]], abs=TOL)
        assert own["decoded_token"] == tok.decode([ids[j]])
        top = sorted((v for k, v in d.items() if v["rank"] <= 2), key=lambda v: v["rank"])
        assert [v["rank"] for v in top][:2] == [1, 2]
        np.testing.assert_allclose([v["logprob"] for v in top[:2]], np.sort(ref[j - 1])[::-1][:2], atol=TOL)
    chat = post(served, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}],
                max_tokens=2, prompt_logprobs=0).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


@pytest.mark.parametrize("body,field", [
    (dict(prompt="hi", max_tokens=0), "max_tokens"),
    (dict(prompt="hi", prompt_logprobs=1, stream=True), "prompt_logprobs"),
    (dict(prompt="hi", prompt_logprobs=21), "prompt_logprobs"),
])
def test_echo_and_prompt_logprobs_errors_name_the_field(served, body, field):
    r = post(served, "/v1/completions", **body)
    assert r.status_code == 400 and field in r.text, r.text
