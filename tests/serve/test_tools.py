"""Tool calling over HTTP against the TP=2 Serve app (``tool_call_parser: hermes``; the test chat
template renders tools in a system turn): forced calls always parse and validate, on a random
model, streamed deltas concatenate to the whole call, auto mode reads Hermes calls out of the
text, and tool results go back into the conversation.  A forced call whose text does not parse
is a 500 naming tool_choice (an error event when streamed), never an empty answer."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.serve.conftest import MODEL_ID
from tests.timescale import scaled

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer",
                                                                                     "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
# A length-bounded string: xgrammar 0.2.9 let raw control characters into it, and the call came
# back as tool_calls=None, content=None, finish_reason "stop".
TIME = {"type": "object", "properties": {"tz": {"type": "string", "minLength": 1, "maxLength": 5}}, "required": ["tz"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "weather in Paris?"}]


def chat(served, **body) -> dict:
    body = {"model": MODEL_ID, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 96, **body}
    r = httpx.post(served.url + "/v1/chat/completions", timeout=scaled(180), json=body)
    assert r.status_code == 200, r.text
    return r.json()


def calls_of(choice) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]]


@pytest.mark.parametrize("seed", range(4))
def test_required_always_returns_calls_that_validate(served, seed):
    """One call (parallel_tool_calls false) always ends and parses.  With parallel calls the array
    is unbounded, as in vLLM, and a random model may fill max_tokens with calls: such a choice ends
    by length with no calls; every other one parses and validates."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:  # both asks at once: 6 sequences, within the app's bounds
        single = pool.submit(chat, served, tool_choice="required", temperature=1.0, seed=seed, n=3,
                             parallel_tool_calls=False)
        parallel = pool.submit(chat, served, tool_choice="required", temperature=1.0, seed=seed, n=3, max_tokens=128)
        out, par = single.result(), parallel.result()
    for c in out["choices"]:
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
        [(name, args)] = calls_of(c)
        jsonschema.validate(args, SCHEMAS[name])
        assert all(x["id"].startswith("chatcmpl-tool-") and x["type"] == "function"
                   for x in c["message"]["tool_calls"])
    for c in par["choices"]:
        if c["finish_reason"] == "length":
            assert "tool_calls" not in c["message"]
            continue
        assert c["finish_reason"] == "tool_calls"
        for name, args in calls_of(c):
            jsonschema.validate(args, SCHEMAS[name])


def test_named_function_is_called(served):
    from concurrent.futures import ThreadPoolExecutor

    forced = {"type": "function", "function": {"name": "get_time"}}
    with ThreadPoolExecutor(6) as pool:  # the six asks at once: within the app's bounds (8 in flight)
        outs = list(pool.map(lambda seed: chat(served, tool_choice=forced, temperature=1.0, seed=seed), range(6)))
    for out in outs:
        [(name, args)] = calls_of(out["choices"][0])
        assert name == "get_time"
        jsonschema.validate(args, TIME)


def test_streamed_tool_call_deltas_concatenate_to_the_call(served):
    body = dict(tool_choice="required", temperature=1.0, seed=5, parallel_tool_calls=False)
    whole = calls_of(chat(served, **body)["choices"][0])
    calls: dict[int, dict] = {}
    finish = None
    with httpx.stream("POST", served.url + "/v1/chat/completions", timeout=scaled(180), json=dict(
            model=MODEL_ID, messages=MESSAGES, tools=TOOLS, max_tokens=96, stream=True, **body)) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for ch in json.loads(line[6:])["choices"]:
                for tc in ch["delta"].get("tool_calls", []):
                    d = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                    d["name"] += tc.get("function", {}).get("name") or ""
                    d["arguments"] += tc.get("function", {}).get("arguments") or ""
                finish = ch["finish_reason"] or finish
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == whole
    assert finish == "tool_calls"


def test_auto_reads_hermes_calls_out_of_the_text(served):
    """The random model is steered into the Hermes format by a grammar; the parser does the rest."""
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call>'
    grammar = 'root ::= "Checking. " ' + json.dumps(call)
    out = chat(served, tool_choice="auto", structured_outputs={"grammar": grammar}, temperature=1.0)
    c = out["choices"][0]
    assert c["message"]["content"] == "Checking."
    assert calls_of(c) == [("get_weather", {"city": "Oslo", "days": 2})] and c["finish_reason"] == "tool_calls"
    plain = chat(served, tool_choice="auto", structured_outputs={"regex": "[a-z ]{3,12}"}, temperature=1.0)
    assert "tool_calls" not in plain["choices"][0]["message"] and plain["choices"][0]["finish_reason"] == "stop"


def test_tools_are_rendered_and_tool_results_go_back(served):
    with_tools = chat(served, max_tokens=1)["usage"]["prompt_tokens"]
    r = httpx.post(served.url + "/v1/chat/completions", timeout=scaled(180),
                   json=dict(model=MODEL_ID, messages=MESSAGES, max_tokens=1))
    assert with_tools > r.json()["usage"]["prompt_tokens"] + 20  # the schemas are in the prompt
    turn = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    out = httpx.post(
        served.url + "/v1/chat/completions", timeout=scaled(180),
        json=dict(model=MODEL_ID, messages=turn, tools=TOOLS, max_tokens=4, tool_choice="none")).json()
    assert out["choices"][0]["message"]["role"] == "assistant" and "tool_calls" not in out["choices"][0]["message"]


def test_openai_sdk_reads_the_calls(served):
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=scaled(180)) as client:
        out = client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                             max_tokens=96, temperature=1.0, seed=2, parallel_tool_calls=False)
    calls = out.choices[0].message.tool_calls
    assert calls and calls[0].function.name in SCHEMAS
    jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS[calls[0].function.name])


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_that_does_not_parse_is_a_500_naming_it(served, stream):
    """A stop string cuts the forced call right after it opens: finish_reason stop with text
    that is no call.  The answer says so (a 500, or the stream's error event), not an empty message."""
    body = {"model": MODEL_ID, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 96, "tool_choice": "required",
            "stop": ["name"], "temperature": 1.0, "seed": 1, "stream": stream}
    if not stream:
        r = httpx.post(served.url + "/v1/chat/completions", timeout=scaled(180), json=body)
        assert r.status_code == 500, r.text
        err = r.json()["error"]
    else:
        with httpx.stream("POST", served.url + "/v1/chat/completions", timeout=scaled(180), json=body) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert r.status_code == 200 and not any(ch["delta"].get("tool_calls") for e in events
                                                for ch in e.get("choices", []))
        [err] = [e["error"] for e in events if "error" in e]
    assert err["param"] == "tool_choice" and err["type"] == "server_error" and "does not parse" in err["message"]


@pytest.mark.parametrize("body,field", [
    (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
    (dict(tools=None, tool_choice="required"), "tool_choice"),
])
def test_bad_tool_requests_name_the_field(served, body, field):
    r = httpx.post(served.url + "/v1/chat/completions", timeout=scaled(60),
                   json=dict({"model": MODEL_ID, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 4}, **body))
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
