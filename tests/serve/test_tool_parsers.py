"""The tool-call parsers (``ray_attn/serve/openai/tools.py``) on the formats the models write, and
streaming: content and calls from any split of the text equal the parse of the whole."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from ray_attn.serve.http import HTTPError
from ray_attn.serve.openai.chat import _parser
from ray_attn.serve.openai.tools import PARSERS, ToolCallStream, forced_calls

CALL = {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}
CALL2 = {"name": "get_time", "arguments": {"tz": "UTC"}}

CASES = {  # parser -> [(text, content, [(name, arguments)])]
    "hermes": [
        (f"<tool_call>\n{json.dumps(CALL)}\n</tool_call>", None, [CALL]),
        (f"Let me check.\n<tool_call>{json.dumps(CALL)}</tool_call>\n<tool_call>{json.dumps(CALL2)}</tool_call>",
         "Let me check.", [CALL, CALL2]),
        ("no call here, just <tool_ text", "no call here, just <tool_ text", []),
        ("<tool_call>{broken json</tool_call>", "<tool_call>{broken json</tool_call>", []),
    ],
    "llama3_json": [
        (json.dumps({"name": "get_weather", "parameters": CALL["arguments"]}), None, [CALL]),
        ("<|python_tag|>" + json.dumps(CALL) + "; " + json.dumps(CALL2), None, [CALL, CALL2]),
        ("The weather is fine.", "The weather is fine.", []),
        ('{"not": "a call"}', '{"not": "a call"}', []),
    ],
    "mistral": [
        ("[TOOL_CALLS]" + json.dumps([CALL, CALL2]), None, [CALL, CALL2]),
        ("Sure. [TOOL_CALLS]" + json.dumps([CALL]), "Sure.", [CALL]),
        ("[TOOL_CALLS] not json", "[TOOL_CALLS] not json", []),
        ("plain answer", "plain answer", []),
    ],
}


@pytest.mark.parametrize("name,case", [(n, c) for n, cs in CASES.items() for c in cs])
def test_parser_reads_its_format(name, case):
    text, content, calls = case
    got_content, got = PARSERS[name]().parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == [(c["name"], c["arguments"]) for c in calls]
    assert len({c.id for c in got}) == len(got)


@pytest.mark.parametrize("name,case", [(n, c) for n, cs in CASES.items() for c in cs])
def test_streaming_any_split_gives_the_whole(name, case):
    text, content, calls = case
    rnd = random.Random(hash(text) & 0xFFFF)
    for _ in range(20):
        cuts = sorted(rnd.sample(range(1, len(text)), min(4, len(text) - 1)))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        s = ToolCallStream(PARSERS[name](), "auto")
        sent, got = "", []
        for i, p in enumerate(pieces):
            out, cs = s.feed(p, i == len(pieces) - 1)
            sent += out
            got += cs
        want_content = content if calls else text
        assert sent.strip() == (want_content or ""), (pieces, sent)
        assert [(c.name, json.loads(c.arguments)) for c in got] == [(c["name"], c["arguments"]) for c in calls]


def test_auto_without_a_parser_is_a_400_naming_tool_choice():
    with pytest.raises(HTTPError) as e:
        _parser(SimpleNamespace(cfg=SimpleNamespace(tool_call_parser=None)))
    assert "tool_choice" in str(e.value.body())


NAMED = SimpleNamespace(function=SimpleNamespace(name="get_time"))


@pytest.mark.parametrize("text,choice", [
    ('[{"name": "get_time", "parameters": {"tz": "U\x11C"}}]', "required"),  # a raw control character
    ('[{"name": "get_time", "parameters": {"tz": "UTC"}}', "required"),  # cut short by a stop string
    ('{"name": "get_time"}', "required"),  # JSON, but no list of calls
    ('{"tz": "a\x01"}', NAMED),
    ('["UTC"]', NAMED),
])
def test_a_forced_call_that_does_not_parse_is_a_500_naming_tool_choice(text, choice):
    """Never a reply with neither content nor calls (finish_reason stop, tool_calls None)."""
    for call in (lambda: forced_calls(text, choice, "stop"),
                 lambda: ToolCallStream(None, choice).feed(text, True, "stop")):
        with pytest.raises(HTTPError) as e:
            call()
        body = e.value.body()
        assert e.value.status == 500 and body["error"]["param"] == "tool_choice"
        assert body["error"]["type"] == "server_error" and "does not parse" in body["error"]["message"]


def test_a_forced_call_cut_by_max_tokens_has_no_calls_and_a_whole_one_parses():
    assert forced_calls('[{"name": "get_ti', "required", "length") == []
    [c] = forced_calls('[{"name": "get_time", "parameters": {"tz": "UTC"}}]', "required", "stop")
    assert (c.name, json.loads(c.arguments)) == ("get_time", {"tz": "UTC"})
    [c] = forced_calls('{"tz": "CET"}', NAMED, "stop")
    assert (c.name, json.loads(c.arguments)) == ("get_time", {"tz": "CET"})
