"""``POST /v1/generate``: the engine's own API (token ids in and out, ``GenerateRequest``), kept
apart from the routes in ``app.py`` so that each module stays readable.  Errors are 422 with the
field named, as pydantic reports them; the OpenAI routes answer 400 (``openai/``)."""

import asyncio
import json
from typing import Optional

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from ray_attn.serve.http import HTTPError, not_taken, read_body, request_failed
from ray_attn.serve import resume as resuming
from ray_attn.serve.loop import AsyncioSink, LoopDead, QueueFull
from ray_attn.serve.schemas import GenerateRequest, GenerateResponse, StreamEvent, Usage, limit_errors, validation_errors


async def generate(server, request: Request):
    """``POST /v1/generate``: token ids (or text) in, token ids (and text) out, streamed as SSE when asked."""
    body = await read_body(request, server.cfg.max_body_bytes)
    try:
        req = GenerateRequest.model_validate_json(body)
    except ValidationError as e:
        errs = validation_errors(e)
        status = 400 if errs and errs[0][1].startswith("body: malformed JSON") else 422
        raise HTTPError(status, errs) from None
    prompt = _prompt_ids(server, req)
    errs = limit_errors(req, prompt, vocab_size=server.vocab_size,
                        max_model_len=server.cfg.engine.model.max_position_embeddings,
                        max_prompt_tokens=server.cfg.max_prompt_tokens,
                        max_tokens_limit=server.cfg.max_tokens_limit,
                        max_stop_token_ids=server.cfg.max_stop_token_ids)
    if errs:
        raise HTTPError(422, errs)
    try:
        params = req.sampling_params()
    except ValueError as e:
        raise HTTPError(422, [(str(e).split(" ", 1)[0], str(e))]) from None
    ctx = resuming.context(request) if req.stream else resuming.NOT_RESUMABLE
    prior = ctx.resume.tokens(0) if ctx.resume is not None else []
    if ctx.resume is not None and ctx.resume.choices.get(0, resuming.ChoiceProgress()).finished:
        async def done():  # every token and the finish were relayed; only the end was lost
            yield "data: [DONE]\n\n"
        return StreamingResponse(done(), media_type="text/event-stream")
    sink = AsyncioSink()
    retry = {"Retry-After": str(server.cfg.retry_after_s)}
    try:
        rid = server.loop.submit(prompt, params, sink, output_token_ids=prior)
    except (QueueFull, LoopDead) as e:
        raise not_taken(e, retry) from None
    try:
        first = await sink.get()
    except asyncio.CancelledError:
        server.loop.abort(rid)
        raise
    if first.kind == "rejected":
        field = "max_tokens" if "max_tokens" in (first.error or "") else "prompt_token_ids"
        raise HTTPError(422, [(field, f"{field}: {first.error}")])
    if first.kind != "accepted":
        raise request_failed(first.error, retry)
    if req.stream:
        shown = ctx.resume.head.get("id", rid) if ctx.resume is not None else rid
        return StreamingResponse(_sse(server, rid, sink, shown, prior, ctx.resumable), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Request-Id": shown})
    tokens: list[int] = []
    last = None
    try:
        while last is None or not last.finished:
            last = await sink.get()
            tokens += last.token_ids
    finally:
        if last is None or not last.finished:
            server.loop.abort(rid)  # the client went away: free its blocks now
    if last.finish_reason == "error":
        # The engine or a rank failed under this request (on this replica once Serve has
        # replaced it, or on another one, a retry may succeed).
        raise request_failed(last.error, retry)
    resp = GenerateResponse(
        id=rid, token_ids=tokens, text=_decode(server, tokens), finish_reason=last.finish_reason or "error",
        error=last.error, usage=Usage(prompt_tokens=len(prompt), completion_tokens=len(tokens)))
    return JSONResponse(resp.model_dump(), headers={"X-Request-Id": rid})

async def _sse(server, rid: str, sink: AsyncioSink, shown_id: str, prior: list[int], resumable: bool):
    """The stream; ``prior`` are tokens a lost replica already streamed under ``shown_id`` (the
    events go on from there), and ``resumable`` adds the front's progress lines (resume.py)."""
    index, finished = len(prior), False
    # Each event's text comes from an incremental detokenizer, fed token by token: the text up to
    # token k is then the same however the events were cut -- by coalescing on a busy replica, or
    # by a resume, whose new replica replays ``prior`` to know what was sent.  (Diffing full
    # decodes was not: a character split across two events decoded as U+FFFD, the next decode no
    # longer began with what was sent, and the whole text went out again.)
    detok = None
    if server.tokenizer is not None:
        from ray_attn.detokenizer import IncrementalDetokenizer

        detok = IncrementalDetokenizer(server.tokenizer)
        detok.add(prior)
    text_sent = len(detok.text) if detok is not None else 0
    if resumable and not prior:
        yield resuming.progress_line(head={"id": shown_id})
    try:
        while not finished:
            ev = await sink.get()
            new, last = list(ev.token_ids), ev
            while not last.finished and not sink.queue.empty():  # coalesce what is ready
                last = sink.queue.get_nowait()
                new += last.token_ids
            finished = last.finished
            text = None
            if detok is not None:
                detok.add(new)
                if finished:
                    detok.finish()  # a trailing incomplete character goes out too, as U+FFFD
                text, text_sent = detok.text[text_sent:], len(detok.text)
            event = StreamEvent(id=shown_id, index=index, token_ids=new, text=text, finished=finished,
                                finish_reason=last.finish_reason if finished else None,
                                error=last.error)
            index += len(new)
            line = f"data: {json.dumps(event.model_dump())}\n\n"
            if resumable:  # an error end is not progress: a resumed request may still finish
                reason = event.finish_reason if event.finish_reason != "error" else None
                line = resuming.choice_progress(0, new, reason) + line
            yield line
        yield "data: [DONE]\n\n"
    finally:
        if not finished:
            server.loop.abort(rid)

def _prompt_ids(server, req: GenerateRequest) -> list[int]:
    if req.prompt_token_ids is not None:
        return req.prompt_token_ids
    if server.tokenizer is None:
        raise HTTPError(422, [("prompt", "prompt: text prompts need a tokenizer folder on the "
                                         "server (app config 'tokenizer'); send prompt_token_ids")])
    return list(server.tokenizer.encode(req.prompt))

def _decode(server, tokens: list[int]) -> Optional[str]:
    if server.tokenizer is None:
        return None
    return server.tokenizer.decode(tokens, skip_special_tokens=True)
