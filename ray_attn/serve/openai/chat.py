"""``POST /v1/chat/completions``: messages rendered by the tokenizer's own chat template."""

import time

from fastapi import Request
from fastapi.responses import JSONResponse

from ray_attn.serve import resume as resuming
from ray_attn.serve.http import HTTPError, read_body
from ray_attn.serve.request_log import current_request_id
from ray_attn.serve.openai.logprobs import prompt_logprobs_json
from ray_attn.serve.openai.protocol import ChatCompletionRequest
from ray_attn.serve.openai.structured import compile_structured, structured_spec
from ray_attn.serve.openai.tools import (
    PARSERS,
    ToolCallStream,
    forced_calls,
    forced_spec,
    template_tools,
)
from ray_attn.serve.openai.serving import (
    build_choices,
    check_model,
    check_prompt,
    finish,
    parse,
    resolve_max_tokens,
    stream_response,
)


def render_prompt(server, req: ChatCompletionRequest) -> list[int]:
    tools = template_tools(req.tools) if req.tools else None
    return render_messages(server, req.messages, req.add_generation_prompt, tools=tools)


def render_messages(server, messages, add_generation_prompt: bool, add_special_tokens: bool = False,
                    continue_final_message: bool = False, tools: list | None = None) -> list[int]:
    """The ids of ``messages`` through the tokenizer's chat template (also ``/tokenize``'s)."""
    tok = server.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise HTTPError(400, [("messages", "messages: chat needs a tokenizer with a chat template on "
                                           "the server (app config 'tokenizer'); use /v1/completions")])
    msgs = []
    for m in messages:
        d = {"role": m.role, "content": m.text()}
        # what templates read besides role and content (vLLM passes the same); the rest of a
        # message (refusal, audio) only names what an earlier answer held
        for key in ("name", "tool_call_id", "tool_calls"):
            if getattr(m, key) is not None:
                d[key] = getattr(m, key)
        msgs.append(d)
    kw = {"continue_final_message": True} if continue_final_message else {}
    if tools:
        kw["tools"] = tools
    try:
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt, **kw)
    except Exception as e:  # noqa: BLE001 - a template may raise anything (jinja's raise_exception)
        raise HTTPError(400, [("messages", f"messages: the chat template refused them: {e}")]) from None
    # The template writes the special tokens itself (BOS, role markers): adding them again would
    # give the model a prompt it was never trained on.
    return list(tok(text, add_special_tokens=add_special_tokens)["input_ids"])


async def create_chat_completion(server, request: Request):
    req = parse(ChatCompletionRequest, await read_body(request, server.cfg.max_body_bytes),
                server.cfg.strict_request_fields)
    check_model(server, req.model)
    ids = render_prompt(server, req)
    check_prompt(server, ids, "messages")
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = resolve_max_tokens(server, req.requested_max_tokens(), len(ids), field)
    spec, field = structured_spec(req)
    mode, parser = req.tool_mode(), None
    if mode == "auto":
        parser = _parser(server)
        if not parser.skip_special_tokens:  # its call markers are special tokens
            req = req.model_copy(update={"skip_special_tokens": False})
    elif mode is not None:  # required, or a named function: forced through a grammar
        if spec is not None:
            raise HTTPError(400, [("tool_choice", f"tool_choice: a forced call cannot be combined with {field}")])
        spec, field = forced_spec(req.tools, mode, req.parallel_tool_calls), "tool_choice"
    await compile_structured(server, spec, field)
    choices = build_choices(server, req, [ids], [max_tokens], req.num_logprobs(), req.prompt_logprobs, spec)
    # A stream that parses tool calls keeps parser state the progress lines do not carry: it is
    # not resumed (the front ends it with an error event if its replica is lost).
    ctx = resuming.context(request) if req.stream and mode is None else resuming.NOT_RESUMABLE
    await choices.submit(ctx.resume)
    # vLLM's id with request id headers: the HTTP request's (X-Request-Id, request_log.py)
    rid, created = f"chatcmpl-{current_request_id()}", int(time.time())
    head = {"id": rid, "created": created, "model": server.model_id}
    if req.stream:
        streams = {c.index: ToolCallStream(parser, mode) for c in choices.choices} if mode else {}

        def chunk(d):
            c = d.choice
            text, delta = d.text, {}
            if mode is not None:
                text, calls = streams[c.index].feed(d.text, d.finished, c.finish_reason)
                if calls:
                    delta["tool_calls"] = [call.to_json(i) for i, call in enumerate(calls)]
            if text:
                delta = dict(content=text, **delta)
            ch = {"index": c.index, "delta": delta,
                  "logprobs": _logprobs(d.logprobs) if c.params.logprobs is not None else None,
                  "finish_reason": _finish_reason(c, "tool_calls" in delta) if d.finished else None,
                  "stop_reason": c.stop_reason if d.finished else None}
            return dict(ch, token_ids=d.token_ids) if req.return_token_ids else ch

        # OpenAI opens each choice with the role, before any content.
        opening = [{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None} for c in choices.choices]
        return stream_response(choices, req, dict(head, object="chat.completion.chunk"), chunk, rid, opening, ctx)
    out = []
    for c in await finish(choices):
        message, calls = {"role": "assistant", "content": c.text}, []
        if mode == "auto":
            message["content"], calls = parser.parse(c.text)
        elif mode is not None:
            message["content"], calls = None, forced_calls(c.text, mode, c.finish_reason)
        if calls:
            message["tool_calls"] = [call.to_json() for call in calls]
        d = {"index": c.index, "message": message,
             "logprobs": _logprobs(c.logprobs) if c.params.logprobs is not None else None,
             "finish_reason": _finish_reason(c, bool(calls)), "stop_reason": c.stop_reason}
        if req.return_token_ids:
            d["token_ids"] = c.token_ids
        out.append(d)
    body = dict(head, object="chat.completion", choices=out, usage=choices.usage())
    if req.prompt_logprobs is not None:  # vLLM's place for them: one prompt, beside the choices
        body["prompt_logprobs"] = prompt_logprobs_json(choices.choices[0])
    return JSONResponse(body, headers={"X-Request-Id": rid})


def _logprobs(entries) -> dict:
    def one(text, lp):
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [dict(one(e.token, e.logprob), top_logprobs=[one(t, v) for t, v in e.top])
                        for e in entries]}


def _parser(server):
    name = server.cfg.tool_call_parser
    if name is None:
        raise HTTPError(400, [("tool_choice", "tool_choice: auto needs a tool_call_parser in the app config "
                                              "(hermes, llama3_json, mistral); required or a named function "
                                              "work without one")])
    return PARSERS[name]()


def _finish_reason(c, called: bool) -> str:
    """OpenAI's: tool_calls when the choice ended in calls."""
    return "tool_calls" if called and c.finish_reason == "stop" else c.finish_reason
