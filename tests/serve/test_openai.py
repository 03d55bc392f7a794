"""The official ``openai`` client against the Serve app (the TP=2 app of ``conftest.py``: Ray worker
actors, a BPE tokenizer with a ChatML template trained in the test, nothing downloaded)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")  # the test extra has it; the GPU machine does not

from tests.serve.conftest import MODEL_ID  # noqa: E402
from tests.timescale import scaled, wait_for  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT = "hello world, the quick brown fox"


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=scaled(120)) as c:
        yield c


@pytest.fixture(scope="module")
def tok(served):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(served.tokenizer_dir, local_files_only=True)


def generate(served, **body) -> dict:
    r = httpx.post(served.url + "/v1/generate", json=body, timeout=scaled(120))
    assert r.status_code == 200, r.text
    return r.json()


def test_models_lists_the_served_model(client, served):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_ID]
    card = models[0].model_dump()
    assert card["max_model_len"] == served.args["engine"]["model"]["max_position_embeddings"]
    assert card["vocab_size"] == served.args["engine"]["model"]["vocab_size"]


def test_greedy_completion_equals_generate(client, served, tok):
    want = generate(served, prompt=PROMPT, max_tokens=12)
    out = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=12, temperature=0,
                                    extra_body={"return_token_ids": True})
    c = out.choices[0]
    assert c.model_extra["token_ids"] == want["token_ids"]
    assert c.text == want["text"] == tok.decode(want["token_ids"], skip_special_tokens=True)
    assert c.finish_reason == want["finish_reason"]
    assert out.usage.prompt_tokens == len(tok(PROMPT)["input_ids"])
    assert out.usage.completion_tokens == len(want["token_ids"])
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    # token ids in, the same tokens out
    ids = tok(PROMPT)["input_ids"]
    again = client.completions.create(model=MODEL_ID, prompt=ids, max_tokens=12, temperature=0)
    assert again.choices[0].text == c.text


def test_streamed_completion_equals_the_whole(client, served):
    whole = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=16, temperature=0.8, seed=3)
    stream = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=16, temperature=0.8,
                                       seed=3, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert len(chunks) > 2  # tokens arrive as they are made, not at the end
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(ch.usage is None for ch in chunks[:-1])


def test_chat_completion_uses_the_chat_template(client, served, tok):
    msgs = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "hello ray"}]
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    want = generate(served, prompt_token_ids=ids, max_tokens=10)
    out = client.chat.completions.create(model=MODEL_ID, messages=msgs, max_completion_tokens=10, temperature=0)
    m = out.choices[0].message
    assert m.role == "assistant" and m.content == want["text"]
    assert out.usage.prompt_tokens == len(ids)
    deltas = list(client.chat.completions.create(model=MODEL_ID, messages=msgs, max_tokens=10, temperature=0,
                                                 stream=True))
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(d.choices[0].delta.content or "" for d in deltas) == want["text"]


def test_n_samples_are_independent_and_reproducible(client):
    kw = dict(model=MODEL_ID, prompt=PROMPT, max_tokens=12, temperature=1.0, n=4, seed=11,
              extra_body={"return_token_ids": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    ids = [c.model_extra["token_ids"] for c in sorted(a.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(a.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    assert ids == [c.model_extra["token_ids"] for c in sorted(b.choices, key=lambda c: c.index)]
    assert len({tuple(x) for x in ids}) == 4  # independent draws, not one draw four times
    one = client.completions.create(**dict(kw, n=1))
    assert one.choices[0].model_extra["token_ids"] == ids[0]  # sample 0 keeps the request's seed
    assert a.usage.completion_tokens == sum(len(x) for x in ids)


def test_stop_string_ends_the_text_at_the_string(client):
    full = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True})
    text = full.choices[0].text
    assert len(text) >= 8, text
    stop = text[4:7]
    cut = text.index(stop)
    out = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    c = out.choices[0]
    assert c.text == text[:cut] and c.finish_reason == "stop" and c.model_extra["stop_reason"] == stop
    assert out.usage.completion_tokens < full.usage.completion_tokens or cut + len(stop) >= len(text)
    kept = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == text[:cut + len(stop)]


def test_logprobs_are_log_softmax_of_the_logits(client, served, tok):
    from tests.serve.helpers import teacher_forced_logits

    out = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                    extra_body={"return_token_ids": True})
    c = out.choices[0]
    prompt = tok(PROMPT)["input_ids"]
    gen = c.model_extra["token_ids"]
    logits = teacher_forced_logits(served.args["engine"], prompt + gen)[len(prompt) - 1:-1]
    ref = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)  # float64 log-softmax
    lp = c.logprobs
    # TP=2 (the app) against TP=1 in float32: the all-reduce order moves logits by ~1e-6
    np.testing.assert_allclose(lp.token_logprobs, ref[np.arange(len(gen)), gen], atol=2e-4)
    for i, top in enumerate(lp.top_logprobs):
        best = np.argsort(-ref[i])[:3]
        want = {tok.decode([int(t)]): ref[i, t] for t in best}
        for text, v in want.items():
            assert top[text] == pytest.approx(v, abs=2e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    chat = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(x.top_logprobs) == 2 for x in content)
    assert all(x.top_logprobs[0].logprob >= x.top_logprobs[1].logprob >= -1e9 for x in content)


def test_sampling_filters_reach_the_device(client):
    greedy = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=10, temperature=0)
    for extra in ({"top_k": 1}, {"min_p": 1.0}):  # each leaves only the most likely token
        out = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=5,
                                        extra_body=extra)
        assert out.choices[0].text == greedy.choices[0].text, extra
    free = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=5)
    assert free.choices[0].text != greedy.choices[0].text
    short = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=10, temperature=0,
                                      extra_body={"min_tokens": 10, "stop_token_ids": [0]})
    assert short.usage.completion_tokens == 10


@pytest.mark.parametrize("kw, param", [
    (dict(temperature=3.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(n=0), "n"),
    (dict(logprobs=21), "logprobs"),
    (dict(max_tokens=100000), "max_tokens"),
    (dict(extra_body={"min_tokens": 20}, max_tokens=5), "min_tokens"),
    (dict(extra_body={"logit_bias": {"512": 1}}), "logit_bias"),
    (dict(extra_body={"logit_bias": {"5": 100.5}}), "logit_bias"),
    (dict(extra_body={"logit_bias": {str(i): 1 for i in range(301)}}), "logit_bias"),
    (dict(extra_body={"prompt_logprobs": 21}), "prompt_logprobs"),
    (dict(extra_body={"top_k": "5"}), "top_k"),
    (dict(prompt=[1, 2, 10**6]), "prompt[2]"),
])
def test_bad_parameters_are_openai_errors_naming_the_field(client, kw, param):
    args = dict(model=MODEL_ID, prompt=PROMPT, max_tokens=4) | kw
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**args)
    body = e.value.body
    assert e.value.status_code == 400 and body["param"] == param, body
    assert body["message"].startswith(param) and body["type"] == "invalid_request_error"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    assert e.value.body["param"] == "model" and MODEL_ID in e.value.body["message"]


def test_chat_without_a_tokenizer_is_refused_by_name(served):
    with openai.OpenAI(base_url=served.plain_url + "/v1", api_key="x", max_retries=0, timeout=scaled(60)) as c:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="ray_attn-random", messages=[{"role": "user", "content": "hi"}])
        assert e.value.body["param"] == "messages"
        out = c.completions.create(model="ray_attn-random", prompt=[5, 6, 7], max_tokens=3, temperature=0)
        assert out.choices[0].text == "" and len(out.choices[0].model_extra["token_ids"]) == 3


def test_bench_serve_measures_the_app_over_http(served):
    """scripts/bench_serve.py (vLLM's flags and keys) against our /v1/completions: every request
    completes, output lengths come from the usage chunk, and the model name from /v1/models."""
    import asyncio
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import bench_serve

    args = bench_serve.parser().parse_args([
        "--base-url", served.url, "--num-prompts", "6", "--random-input-len", "16", "--random-output-len", "5",
        "--max-concurrency", "3", "--disable-tqdm"])
    r = asyncio.run(bench_serve.benchmark(args))
    assert r["completed"] == 6 and r["failed"] == 0, r["errors"]
    assert r["output_lens"] == [5] * 6 and r["total_input_tokens"] == 6 * 16  # ignore_eos, token-id prompts
    # a token whose text is still an incomplete character streams as an empty chunk, which vLLM's
    # client (and ours) does not count as a token arrival: at most 4 gaps per request
    assert r["model_id"] == MODEL_ID and all(1 <= len(itl) <= 4 for itl in r["itls"])


def test_n_samples_share_the_prompts_blocks(client, served):
    """The n samples are queued together and admitted in one step: the first computes the
    prompt's full blocks and the others hit them in that same step (/stats counts the hits)."""
    prompt = np.random.default_rng(3).integers(3, 400, 60).tolist()  # 3 full 16-token blocks
    with httpx.Client(base_url=served.url, timeout=scaled(30)) as c:
        before = c.get("/stats").json()["prefix_cache_hits"]
        out = client.completions.create(model=MODEL_ID, prompt=prompt, n=4, max_tokens=3, temperature=1.0, seed=9)
        assert len(out.choices) == 4
        # /stats is the engine loop's last snapshot: three samples found the first one's 48 prompt tokens
        assert wait_for(lambda: c.get("/stats").json()["prefix_cache_hits"] - before >= 3 * 48, 10, 0.2)


# ----------------------------------------------------------------------------------- issue 23
def test_fields_the_sdks_send_are_accepted(client):
    """Every field of OpenAI's chat schema the SDK sends, and a field nobody defines (logged and
    ignored: the main app is not strict), answer as the bare request does."""
    msgs = [{"role": "user", "content": "hello ray"}]
    bare = client.chat.completions.create(model=MODEL_ID, messages=msgs, max_tokens=4, temperature=0)
    full = client.chat.completions.create(
        model=MODEL_ID, messages=msgs, max_completion_tokens=4, temperature=0, store=False,
        metadata={"k": "v"}, parallel_tool_calls=False, reasoning_effort="low", service_tier="auto",
        user="u1", modalities=["text"], prediction={"type": "content", "content": "hi"},
        web_search_options={}, tool_choice="none", response_format={"type": "text"},
        prompt_cache_key="p", safety_identifier="s", verbosity="low",
        extra_body={"no_such_field": 1, "chat_template_kwargs": {"x": 1}})
    assert full.choices[0].message.content == bare.choices[0].message.content
    out = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=3, temperature=0, user="u",
                                    suffix=None, echo=False, best_of=1, extra_body={"made_up": [1, 2]})
    assert out.usage.completion_tokens == 3


def test_strict_request_fields_refuses_unknown_fields_by_name(served):
    """The /plain app sets strict_request_fields: an unknown field is a 400 naming it (nested too),
    while OpenAI's own fields still pass."""
    url = served.plain_url + "/v1/completions"
    base = {"model": "ray_attn-random", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
    for extra, param in (({"no_such_field": 1}, "no_such_field"),
                         ({"stream": True, "stream_options": {"include_usage": True, "zz": 1}},
                          "stream_options.zz")):
        r = httpx.post(url, json=base | extra, timeout=scaled(60))
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert r.json()["error"]["message"].startswith(f"{param}: unknown field")
    r = httpx.post(url, json=base | {"user": "u", "logit_bias": {"5": 1}, "seed": 3}, timeout=scaled(60))
    assert r.status_code == 200, r.text


def test_logit_bias_forces_and_bans_tokens(client):
    greedy = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=5, temperature=0,
                                       extra_body={"return_token_ids": True})
    ids = greedy.choices[0].model_extra["token_ids"]
    forced = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=5, temperature=0,
                                       logit_bias={"77": 100}, extra_body={"return_token_ids": True})
    assert forced.choices[0].model_extra["token_ids"] == [77] * 5
    banned = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=5, temperature=0,
                                       logit_bias={str(t): -100 for t in set(ids)},
                                       extra_body={"return_token_ids": True})
    assert not set(banned.choices[0].model_extra["token_ids"]) & set(ids)
    chat = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3, temperature=0, logit_bias={"77": 100},
                                          extra_body={"return_token_ids": True})
    assert chat.choices[0].model_extra["token_ids"] == [77] * 3


def test_text_offset_counts_the_token_strings_on_multibyte_output(client):
    """Seeded sampled output over a vocabulary full of byte fragments: each token's text_offset
    is the previous one's plus the length of the previous token's string (vLLM's count; issue 37:
    the old offsets into the text did not add up over the tokens)."""
    from tests.serve.test_openai_offsets import check_offsets

    for seed in range(12):
        out = client.completions.create(model=MODEL_ID, prompt="日本語のテキスト 🚀", max_tokens=16,
                                        temperature=1.0, seed=seed, logprobs=1)
        check_offsets(out.choices[0].logprobs.model_dump())


def test_usage_reports_cached_prompt_tokens(client, served):
    prompt = "the quick brown fox jumps over the lazy dog, " * 3  # > two 16-token blocks
    first = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=2, temperature=0)
    hit = again.usage.prompt_tokens_details.cached_tokens
    assert 16 <= hit <= first.usage.prompt_tokens and hit % 16 == 0  # whole 16-token blocks
    stream = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=2, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    usage = [ch.usage for ch in stream if ch.usage is not None][-1]
    assert usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens_details.cached_tokens
    msgs = [{"role": "user", "content": prompt}]
    client.chat.completions.create(model=MODEL_ID, messages=msgs, max_tokens=2, temperature=0)
    chat = client.chat.completions.create(model=MODEL_ID, messages=msgs, max_tokens=2, temperature=0)
    assert chat.usage.prompt_tokens_details.cached_tokens >= 16


def test_tokenize_and_detokenize_as_vllm(served, tok, client):
    with httpx.Client(base_url=served.url, timeout=scaled(60)) as h:
        r = h.post("/tokenize", json={"model": MODEL_ID, "prompt": PROMPT})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["tokens"] == tok(PROMPT)["input_ids"] and body["count"] == len(body["tokens"])
        assert body["max_model_len"] == served.args["engine"]["model"]["max_position_embeddings"]
        msgs = [{"role": "user", "content": "hello ray"}]
        chat = h.post("/tokenize", json={"messages": msgs, "return_token_strs": True}).json()
        used = client.chat.completions.create(model=MODEL_ID, messages=msgs, max_tokens=1).usage
        assert chat["count"] == used.prompt_tokens and len(chat["token_strs"]) == chat["count"]
        back = h.post("/detokenize", json={"model": MODEL_ID, "tokens": body["tokens"]}).json()
        assert back == {"prompt": PROMPT}
        r = h.post("/detokenize", json={"tokens": [1, 10**6]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens[1]"
        r = h.post("/tokenize", json={"model": "gpt-4", "prompt": "x"})
        assert r.status_code == 404


def test_metrics_on_the_api_port(served, client):
    client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=2, temperature=0)
    r = httpx.get(served.url + "/metrics", timeout=scaled(60))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    lines = r.text.splitlines()
    assert "# TYPE ray_attn_tokens_generated counter" in lines
    tokens = [ln for ln in lines if ln.startswith("ray_attn_tokens_generated_total{replica=")]
    assert tokens and float(tokens[0].rsplit(" ", 1)[1]) >= 2
    assert any(ln.startswith('ray_attn_step_latency_s_bucket{replica="') and 'le="+Inf"' in ln for ln in lines)
