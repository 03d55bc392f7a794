"""``POST /v1/completions``: OpenAI's legacy completions, text or token ids in, text out."""

import dataclasses
import time

from fastapi import Request
from fastapi.responses import JSONResponse

from ray_attn.serve import resume as resuming
from ray_attn.serve.http import HTTPError, read_body
from ray_attn.serve.request_log import current_request_id
from ray_attn.serve.openai.logprobs import prompt_entries, prompt_logprobs_json, token_chars
from ray_attn.serve.openai.protocol import CompletionRequest
from ray_attn.serve.openai.structured import compile_structured, structured_spec
from ray_attn.serve.openai.serving import (
    build_choices,
    check_model,
    check_prompt,
    finish,
    parse,
    resolve_max_tokens,
    stream_response,
)


def _tokenize(server, prompt, index: int, many: bool) -> tuple[list[int], str]:
    field = f"prompt[{index}]" if many else "prompt"
    if isinstance(prompt, list):
        return list(prompt), field
    if server.tokenizer is None:
        raise HTTPError(400, [(field, f"{field}: text prompts need a tokenizer on the server (app config "
                                      f"'tokenizer'); send token ids")])
    return list(server.tokenizer(prompt, add_special_tokens=True)["input_ids"]), field


async def create_completion(server, request: Request):
    req = parse(CompletionRequest, await read_body(request, server.cfg.max_body_bytes),
                server.cfg.strict_request_fields)
    check_model(server, req.model)
    raw = req.prompts()
    prompts, max_tokens = [], []
    for i, p in enumerate(raw):
        ids, field = _tokenize(server, p, i, len(raw) > 1)
        check_prompt(server, ids, field)
        prompts.append(ids)
        max_tokens.append(resolve_max_tokens(server, req.max_tokens, len(ids), "max_tokens"))
    # echo with logprobs returns the prompt's logprobs too, with the same top k (vLLM's rule)
    prompt_k = req.prompt_logprobs
    if prompt_k is None and req.echo and req.logprobs is not None:
        prompt_k = req.logprobs
    spec, field = structured_spec(req)
    await compile_structured(server, spec, field)
    choices = build_choices(server, req, prompts, max_tokens, req.logprobs, prompt_k, spec)
    ctx = resuming.context(request) if req.stream else resuming.NOT_RESUMABLE
    await choices.submit(ctx.resume)
    # vLLM's id with request id headers: the HTTP request's (X-Request-Id, request_log.py)
    rid, created = f"cmpl-{current_request_id()}", int(time.time())
    head = {"id": rid, "object": "text_completion", "created": created, "model": server.model_id}
    with_ids = req.return_token_ids or server.tokenizer is None
    echo = _Echo(server, req, raw)
    if req.stream:
        opened: set[int] = set(ctx.resume.choices) if ctx.resume is not None else set()  # echoed already

        def chunk(d):
            c = d.choice
            text, entries = d.text, echo.shifted(c, d.logprobs)
            if req.echo and c.index not in opened:  # the prompt opens each choice's first chunk
                opened.add(c.index)
                text, entries = echo.text(c) + text, prompt_entries(c) + entries
            ch = {"index": c.index, "text": text, "logprobs": _logprobs(entries) if req.logprobs is not None
                  else None, "finish_reason": c.finish_reason if d.finished else None,
                  "stop_reason": c.stop_reason if d.finished else None}
            return dict(ch, token_ids=d.token_ids) if with_ids else ch

        return stream_response(choices, req, head, chunk, rid, ctx=ctx)
    body = dict(head, choices=[_choice(c, with_ids, echo) for c in await finish(choices)], usage=choices.usage())
    return JSONResponse(body, headers={"X-Request-Id": rid})


class _Echo:
    """The prompt in front of each choice when ``echo`` is set: the prompt as sent when it was
    text, else its tokens decoded; with logprobs, its tokens' entries before the completion's.
    The offsets run on over the prompt's entries into the completion's (vLLM's count over
    prompt + output tokens), in every streamed chunk as in the whole answer."""

    def __init__(self, server, req, raw_prompts):
        self.server, self.req, self.raw = server, req, raw_prompts
        self._decoded: dict[int, str] = {}  # prompt index -> its tokens decoded
        self._chars: dict[int, int] = {}  # prompt index -> its token strings' lengths, summed

    def _decode(self, c) -> str:
        """The prompt's tokens decoded as output is (``IncrementalDetokenizer``); "" without a
        tokenizer."""
        tok = self.server.tokenizer
        if tok is None:
            return ""
        if c.prompt_index not in self._decoded:
            from ray_attn.detokenizer import IncrementalDetokenizer

            d = IncrementalDetokenizer(tok, (), skip_special_tokens=self.req.skip_special_tokens)
            d.add(c.prompt_ids)
            d.finish()
            self._decoded[c.prompt_index] = d.text
        return self._decoded[c.prompt_index]

    def text(self, c) -> str:
        if not self.req.echo:
            return ""
        p = self.raw[c.prompt_index]
        return p if isinstance(p, str) else self._decode(c)

    def shifted(self, c, completion: list) -> list:
        """The completion's entries, their offsets moved past the prompt's entries when echoed."""
        if not self.req.echo or not completion:
            return completion
        if c.prompt_index not in self._chars:
            self._chars[c.prompt_index] = token_chars(c, c.prompt_ids)
        shift = self._chars[c.prompt_index]
        return [dataclasses.replace(e, offset=e.offset + shift) for e in completion]

    def entries(self, c, completion: list) -> list:
        if not self.req.echo:
            return completion
        return prompt_entries(c) + self.shifted(c, completion)


def _logprobs(entries) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        out["tokens"].append(e.token)
        out["token_logprobs"].append(e.logprob)
        if e.top is None:  # an echoed prompt's first token
            out["top_logprobs"].append(None)
        else:
            # vLLM's completions shape: the top k, plus the sampled token when it is not among them
            top = dict(e.top)
            top.setdefault(e.token, e.logprob)
            out["top_logprobs"].append(top)
        out["text_offset"].append(e.offset)
    return out


def _choice(c, with_ids: bool, echo: _Echo) -> dict:
    d = {"index": c.index, "text": echo.text(c) + c.text, "finish_reason": c.finish_reason,
         "stop_reason": c.stop_reason,
         "logprobs": _logprobs(echo.entries(c, c.logprobs)) if c.params.logprobs is not None else None}
    if echo.req.prompt_logprobs is not None:
        d["prompt_logprobs"] = prompt_logprobs_json(c)
    if with_ids:
        d.update(token_ids=c.token_ids, prompt_token_ids=c.prompt_ids)
    return d
