"""Tool calling on ``/v1/chat/completions``, as vLLM serves it.

- The tools reach the model through the tokenizer's chat template (``tools=`` of
  ``apply_chat_template``), and ``tool`` role messages come back the same way.
- ``tool_choice="auto"``: the model writes calls in its own format and the app's
  ``tool_call_parser`` (vLLM's ``--tool-call-parser``) reads them out of the text: ``hermes``
  (Hermes and Qwen's ``<tool_call>{...}</tool_call>``), ``llama3_json`` (Llama 3.x's bare JSON
  object, after an optional ``<|python_tag|>``) or ``mistral`` (``[TOOL_CALLS][{...}]``).  Text
  that does not parse stays content, as in vLLM.
- ``"required"`` and a named function are forced through structured outputs, so the call always
  parses: a JSON array of ``{"name", "parameters"}`` over the tools' schemas, or the named
  function's parameters.  One that still does not (cut by a stop string, a grammar fault) is a
  500 naming ``tool_choice``, never a reply with neither content nor calls.
- Streaming sends content as it comes until a call may have begun, then the calls whole in the
  last delta: each tool call's deltas concatenate to the non-streamed call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Optional

from ray_attn.structured_output import StructuredOutputsParams


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = ""

    def __post_init__(self):
        self.id = self.id or f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"

    def to_json(self, index: Optional[int] = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else dict(d, index=index)


def _call(obj) -> Optional[ToolCall]:
    """A parsed ``{"name", "arguments" | "parameters"}`` object as a call, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


class ToolParser:
    """Reads tool calls out of a model's text.  ``start`` is where a call may begin: streamed
    content is held back from there (and from any tail that could be its beginning)."""

    start = ""
    skip_special_tokens = True  # False where the call markers are special tokens

    def parse(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        raise NotImplementedError

    def safe_prefix(self, text: str) -> int:
        """How much of ``text`` can be streamed as content now."""
        i = text.find(self.start)
        if i >= 0:
            return i
        for k in range(min(len(self.start) - 1, len(text)), 0, -1):
            if self.start.startswith(text[-k:]):
                return len(text) - k
        return len(text)


class HermesParser(ToolParser):
    start = "<tool_call>"
    _call_re = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text):
        i = text.find(self.start)
        if i < 0:
            return text, []
        calls = []
        for body in self._call_re.findall(text[i:]):
            try:
                c = _call(json.loads(body))
            except ValueError:
                c = None
            if c is None:
                return text, []  # not a call after all: all of it is content
            calls.append(c)
        return (text[:i].strip() or None), calls


class Llama3JsonParser(ToolParser):
    start = "<|python_tag|>"
    skip_special_tokens = False

    def parse(self, text):
        body = text.strip()
        if body.startswith(self.start):
            body = body[len(self.start):].strip()
        if not body.startswith("{"):
            return text, []
        calls, dec, pos = [], json.JSONDecoder(), 0
        try:
            while pos < len(body):
                obj, end = dec.raw_decode(body, pos)
                c = _call(obj)
                if c is None:
                    return text, []
                calls.append(c)
                pos = end
                while pos < len(body) and body[pos] in " \n;":  # Llama 3.x separates calls by ';'
                    pos += 1
        except ValueError:
            return text, []
        return None, calls

    def safe_prefix(self, text):
        """A call is the whole output: until the text shows it is not one, none of it is sent."""
        s = text.lstrip()
        n = len(self.start)
        if not s or s.startswith("{") or s.startswith(self.start) or self.start.startswith(s[:n]):
            return 0
        return len(text)


class MistralParser(ToolParser):
    start = "[TOOL_CALLS]"
    skip_special_tokens = False

    def parse(self, text):
        i = text.find(self.start)
        if i < 0:
            return text, []
        try:
            obj = json.loads(text[i + len(self.start):].strip())
        except ValueError:
            return text, []
        objs = obj if isinstance(obj, list) else [obj]
        calls = [_call(o) for o in objs]
        if not calls or None in calls:
            return text, []
        return (text[:i].strip() or None), calls


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser}


# ---------------------------------------------------------------------- forced calls
def template_tools(tools) -> list[dict]:
    """The tools as chat templates read them (OpenAI's shape)."""
    return [{"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in tools]


def _parameters(tool) -> dict:
    return tool.function.parameters or {"type": "object", "properties": {}}


def forced_spec(tools, tool_choice, parallel_tool_calls: Optional[bool]) -> Optional[StructuredOutputsParams]:
    """The grammar of a forced call ("required" or a named function), else None."""
    if tool_choice == "required":
        item = {"anyOf": [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                            "parameters": _parameters(t)},
                           "required": ["name", "parameters"], "additionalProperties": False} for t in tools]}
        schema = {"type": "array", "items": item, "minItems": 1}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=json.dumps(schema))
    if isinstance(tool_choice, str) or tool_choice is None:
        return None
    tool = next(t for t in tools if t.function.name == tool_choice.function.name)
    return StructuredOutputsParams(json=json.dumps(_parameters(tool)))


def forced_calls(text: str, tool_choice, finish_reason: Optional[str] = "stop") -> list[ToolCall]:
    """The calls of a forced output.  It matches ``forced_spec``'s grammar unless cut short by
    max_tokens (``finish_reason`` "length"), in which case there are none.  Text that ended any
    other way and is not the call (a grammar that let a wrong byte through, a stop string that cut
    it) is a 500 naming tool_choice: a forced call never comes back as an empty answer."""
    if finish_reason == "length":
        return []
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise _unparsable(text, f"not JSON: {e}") from None
    if tool_choice == "required":
        if not isinstance(obj, list) or not obj or not all(
                isinstance(o, dict) and isinstance(o.get("name"), str) and "parameters" in o for o in obj):
            raise _unparsable(text, 'not a list of {"name", "parameters"} objects')
        return [ToolCall(o["name"], json.dumps(o["parameters"], ensure_ascii=False)) for o in obj]
    if not isinstance(obj, dict):
        raise _unparsable(text, "the arguments are not a JSON object")
    return [ToolCall(tool_choice.function.name, text)]


def _unparsable(text: str, why: str):
    from ray_attn.serve.http import HTTPError

    return HTTPError(500, [("tool_choice", f"tool_choice: the forced tool call the model wrote does not "
                                           f"parse ({why}); its text: {text[:200]!r}")])


class ToolCallStream:
    """One streamed choice: content deltas until a call may have begun, then the calls at the end."""

    def __init__(self, parser: Optional[ToolParser], tool_choice):
        self.parser, self.tool_choice = parser, tool_choice
        self.text, self.sent = "", 0

    def feed(self, delta: str, finished: bool, finish_reason: Optional[str] = "stop") -> tuple[str, list[ToolCall]]:
        """(content to send now, the calls once finished); a forced call that does not parse
        raises ``forced_calls``'s 500."""
        self.text += delta
        if self.parser is None:  # forced: the whole output is the call
            return "", (forced_calls(self.text, self.tool_choice, finish_reason) if finished else [])
        if not finished:
            safe = max(self.sent, self.parser.safe_prefix(self.text))
            out, self.sent = self.text[self.sent:safe], safe
            return out, []
        content, calls = self.parser.parse(self.text)
        if not calls:
            out, self.sent = self.text[self.sent:], len(self.text)
            return out, []
        # content before the call that was held back (the parser strips it; send what remains)
        out = (content or "")[self.sent:]
        self.sent = len(self.text)
        return out, calls
