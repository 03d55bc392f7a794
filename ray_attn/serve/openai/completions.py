"""``POST /v1/completions``: OpenAI's legacy completions, text or token ids in, text out."""

import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse

from ray_attn.serve.http import HTTPError, read_body
from ray_attn.serve.openai.protocol import CompletionRequest
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
    choices = build_choices(server, req, prompts, max_tokens, req.logprobs)
    await choices.submit()
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": rid, "object": "text_completion", "created": created, "model": server.model_id}
    with_ids = req.return_token_ids or server.tokenizer is None
    if req.stream:
        def chunk(d):
            c = d.choice
            ch = {"index": c.index, "text": d.text, "logprobs": _logprobs(d.logprobs) if c.params.logprobs is not None
                  else None, "finish_reason": c.finish_reason if d.finished else None,
                  "stop_reason": c.stop_reason if d.finished else None}
            return dict(ch, token_ids=d.token_ids) if with_ids else ch

        return stream_response(choices, req, head, chunk, rid)
    body = dict(head, choices=[_choice(c, with_ids) for c in await finish(choices)], usage=choices.usage())
    return JSONResponse(body, headers={"X-Request-Id": rid})


def _logprobs(entries) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        out["tokens"].append(e.token)
        out["token_logprobs"].append(e.logprob)
        # vLLM's completions shape: the top k, plus the sampled token when it is not among them
        top = dict(e.top)
        top.setdefault(e.token, e.logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(e.offset)
    return out


def _choice(c, with_ids: bool) -> dict:
    d = {"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
         "logprobs": _logprobs(c.logprobs) if c.params.logprobs is not None else None}
    if with_ids:
        d.update(token_ids=c.token_ids, prompt_token_ids=c.prompt_ids)
    return d
