"""``usage`` of answers with several choices, and the usage chunk of a resumed stream.

vLLM counts ``prompt_tokens`` once per prompt however many samples it has (``num_prompt_tokens``
of the request, ``serving_completion.py``), and so do we; ``cached_tokens`` is, per prompt, the
hits of its sample that hit least (the n samples of a prompt are admitted together and hit what
the first one computes), summed over the prompts.  The handlers run in process
(``openai_harness``) against an engine loop that reports given hits per engine request, so the
samples of one prompt can be made to differ."""

from __future__ import annotations

import asyncio
import json

import pytest

from ray_attn.serve.ingress import RelayedResponse, RoutedHTTPRequest
from ray_attn.serve.openai.chat import create_chat_completion
from ray_attn.serve.openai.completions import create_completion
from ray_attn.serve.resume import ChoiceProgress, Resume, choice_progress, progress_line
from tests.serve.openai_harness import Script, ScriptedLoop, answer, request, server

P0, P1 = [7, 8, 9, 10, 11], [20, 21, 22]
# choice index = prompt index x n + sample: prompt 0's samples hit 16, 0, 32 tokens, prompt 1's 48, 32, 48
SCRIPTS = [Script([1, 2], 16), Script([3], 0), Script([4, 5, 6], 32),
           Script([1], 48), Script([2, 3], 32), Script([4], 48)]


def usage_of(out) -> dict:
    """A whole answer's usage, or a stream's final usage chunk's (the only chunk with usage)."""
    if isinstance(out, dict):
        return out["usage"]
    chunks = [e for e in out if isinstance(e, dict) and e.get("usage")]
    assert len(chunks) == 1 and chunks[0]["choices"] == [], out
    return chunks[0]["usage"]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_usage_counts_each_prompt_once_and_its_least_lucky_sample(stream):
    loop = ScriptedLoop(SCRIPTS)
    body = dict(prompt=[P0, P1], n=3, max_tokens=3, stream=stream, stream_options={"include_usage": True}
                if stream else None)
    u = usage_of(answer(create_completion, server(None, loop), body))
    assert len(loop.submitted) == 6
    done = sum(len(s.output) for s in SCRIPTS)
    assert u["prompt_tokens"] == len(P0) + len(P1)  # not 3 x (5 + 3)
    assert u["completion_tokens"] == done and u["total_tokens"] == len(P0) + len(P1) + done
    assert u["prompt_tokens_details"] == {"cached_tokens": 0 + 32}  # min of each prompt, summed


def test_one_prompt_many_samples_and_one_sample():
    """n=3 of one prompt: its fewest hits; n=1: that sample's hits."""
    for scripts, n, cached in ((SCRIPTS[3:], 3, 32), (SCRIPTS[:1], 1, 16), (SCRIPTS[1:3], 2, 0)):
        loop = ScriptedLoop(scripts)
        u = answer(create_completion, server(None, loop), dict(prompt=P0, n=n, max_tokens=3))["usage"]
        assert u["prompt_tokens"] == len(P0) and u["prompt_tokens_details"] == {"cached_tokens": cached}
        assert u["completion_tokens"] == sum(len(s.output) for s in scripts)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from tests.tokenizer_fixture import build_tokenizer

    folder = tmp_path_factory.mktemp("tok")
    build_tokenizer(folder, 512)
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_usage_with_n_samples(tok, stream):
    loop = ScriptedLoop(SCRIPTS[3:])
    body = dict(messages=[{"role": "user", "content": "hello world"}], n=3, max_tokens=3, stream=stream,
                stream_options={"include_usage": True} if stream else None)
    u = usage_of(answer(create_chat_completion, server(tok, loop), body))
    prompt = loop.submitted[0][0]
    assert all(p == prompt for p, _, _ in loop.submitted)
    assert u["prompt_tokens"] == len(prompt) and u["prompt_tokens_details"] == {"cached_tokens": 32}


# ------------------------------------------------------------------- a resumed stream's usage
def resumed(usage_sent: bool, finished: bool = True):
    """A stream of two choices resumed after both finished (only what followed was lost)."""
    done = "length" if finished else None
    resume = Resume({"id": "cmpl-lost", "created": 3},
                    {0: ChoiceProgress([1, 2], done), 1: ChoiceProgress([3], done)}, usage_sent)
    loop = ScriptedLoop([Script([1, 2, 5]), Script([3, 6])])
    body = dict(prompt=P0, n=2, max_tokens=3, stream=True, stream_options={"include_usage": True})
    return loop, answer(create_completion, server(None, loop), body, resume.to_json())


def test_a_resumed_stream_whose_usage_went_out_sends_only_done():
    loop, events = resumed(usage_sent=True)
    assert events == ["[DONE]"] and loop.submitted == []


def test_a_resumed_stream_whose_usage_was_lost_sends_it_once():
    """The usage chunk counts what the lost replica streamed too, under the lost stream's id."""
    loop, events = resumed(usage_sent=False)
    assert loop.submitted == [] and events[-1] == "[DONE]" and len(events) == 2
    assert events[0]["id"] == "cmpl-lost" and events[0]["usage"]["completion_tokens"] == 3
    assert events[0]["usage"]["prompt_tokens"] == len(P0)
    loop, events = resumed(usage_sent=False, finished=False)  # lost mid-way: the rest, then usage
    assert [p[2] for p in loop.submitted] == [[1, 2], [3]]
    assert usage_of(events)["completion_tokens"] == 5 and events[-1] == "[DONE]"


def test_the_front_records_a_usage_chunk_and_the_next_replica_does_not_repeat_it():
    """The whole path without Ray: a replica streams both choices' ends and the usage chunk
    (with its progress line), then dies before ``[DONE]``; the front asks the next replica with
    ``usage_sent``, and that replica -- the real handler -- answers ``[DONE]`` alone."""
    usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    first = [{"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]},
             {"type": "http.response.body", "more_body": True,
              "body": (progress_line(head={"id": "cmpl-lost", "created": 3})
                       + choice_progress(0, [1, 2], "length") + "data: {}\n\n"
                       + choice_progress(1, [3], "length") + "data: {}\n\n").encode()},
             {"type": "http.response.body", "more_body": True,
              "body": (progress_line(u=True) + "data: " + json.dumps({"usage": usage}) + "\n\n").encode()}]
    asked, sent = [], []

    def replicas(routed):
        asked.append(routed)

        async def gen():
            if len(asked) == 1:
                for m in first:
                    yield m
                raise RuntimeError("replica died")
            loop = ScriptedLoop([Script([1, 2]), Script([3])])
            body = dict(prompt=P0, n=2, max_tokens=3, stream=True, stream_options={"include_usage": True})
            resp = await create_completion(server(None, loop), request(body, routed.resume))
            async for chunk in resp.body_iterator:
                yield {"type": "http.response.body", "body": chunk.encode(), "more_body": True}
            yield {"type": "http.response.body", "body": b"", "more_body": False}
        return gen()

    async def send(m):
        sent.append(m)

    routed = RoutedHTTPRequest({"type": "http"}, b"{}", resumable=True)
    asyncio.run(RelayedResponse(replicas, routed, retry_after_s=1, max_attempts=2, retry_delay_s=0.0)(
        None, None, send))
    assert len(asked) == 2 and asked[1].resume["usage_sent"] is True
    relayed = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body").decode()
    assert relayed.count('"usage"') == 1 and relayed.endswith("data: [DONE]\n\n"), relayed
