"""The OpenAI endpoints' handlers run in this process, without Ray or Serve: ``create_completion``
and ``create_chat_completion`` on a starlette request, against an engine loop that streams given
token ids (with logprobs and prefix-cache hits) in given chunks -- so that offsets, usage and
resumed streams can be checked answer by answer on output no seeded model would be sure to give."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional

from starlette.requests import Request

from ray_attn.request import TokenLogprobs
from ray_attn.serve.loop import Event
from ray_attn.serve.resume import EXTENSION
from ray_attn.serve.schemas import ServeAppConfig

VOCAB = 512


@dataclass
class Script:
    """What the engine does with one request: its output ids, sent ``chunk`` at a time, and how
    many of its prompt tokens were prefix-cache hits."""

    output: list[int]
    cached: int = 0
    finish_reason: str = "length"


@dataclass
class ScriptedLoop:
    """The engine loop's interface (``submit``, ``abort``): the k-th request submitted gets
    ``scripts[k]`` (cycling).  A resumed request (``output_token_ids``) goes on after them."""

    scripts: list[Script]
    chunk: int = 1
    submitted: list[tuple[list[int], object, list[int]]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)

    def submit(self, prompt_ids, params, sink, output_token_ids=()) -> str:
        k = len(self.submitted)
        self.submitted.append((list(prompt_ids), params, list(output_token_ids)))
        s = self.scripts[k % len(self.scripts)]
        rid = f"req-{k}"
        sink.push(Event("accepted"))
        out = s.output[len(output_token_ids):]
        plps = None
        if params.prompt_logprobs is not None:
            plps = [None] + [TokenLogprobs(t, -2.0, 3, [(t, -2.0)]) for t in prompt_ids[1:]]
        for i in range(0, len(out), self.chunk):
            part, last = out[i:i + self.chunk], i + self.chunk >= len(out)
            lps = None if params.logprobs is None else [TokenLogprobs(t, -0.5, 1, [(t, -0.5)]) for t in part]
            sink.push(Event("tokens", part, last, s.finish_reason if last else None, None, lps,
                            num_cached_tokens=s.cached, prompt_logprobs=plps if i == 0 else None))
        return rid

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)


def server(tokenizer, loop: ScriptedLoop, **cfg):
    """What the handlers read of an ``LLMServer``."""
    return SimpleNamespace(cfg=ServeAppConfig.model_validate(cfg), tokenizer=tokenizer, vocab_size=VOCAB,
                           max_model_len=2048, model_id="m", loop=loop, eos_token_ids=[])


def request(body: dict, resume: Optional[dict] = None, path: str = "/v1/completions") -> Request:
    raw = json.dumps(body).encode()
    sent = False

    async def receive():
        nonlocal sent
        if sent:
            await asyncio.Event().wait()
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": path, "headers": [], "query_string": b""}
    if resume is not None:  # as the replica's handle_http puts the front's ask
        scope["extensions"] = {EXTENSION: {"resumable": True, "resume": resume}}
    return Request(scope, receive)


def answer(handler, srv, body: dict, resume: Optional[dict] = None):
    """The handler's answer: the JSON body, or for a stream the list of its ``data:`` payloads
    (JSON objects, then the string ``[DONE]``)."""

    async def run():
        resp = await handler(srv, request(body, resume))
        if not body.get("stream"):
            return json.loads(resp.body)
        text = "".join([c if isinstance(c, str) else c.decode() async for c in resp.body_iterator])
        out = []
        for line in text.split("\n\n"):
            if line.startswith("data: "):
                out.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
        return out

    return asyncio.run(run())


def streamed_logprobs(events: list, index: int = 0) -> dict:
    """One choice's streamed completions logprobs, chunk after chunk, as one list each."""
    out = {"tokens": [], "text_offset": [], "token_logprobs": []}
    for e in events:
        if isinstance(e, dict):
            for ch in e["choices"]:
                if ch["index"] == index and ch.get("logprobs"):
                    for k in out:
                        out[k] += ch["logprobs"][k]
    return out


def streamed_text(events: list, index: int = 0) -> str:
    return "".join(ch["text"] for e in events if isinstance(e, dict) for ch in e["choices"] if ch["index"] == index)
