"""One OpenAI request as engine requests: every (prompt, sample) pair is a choice, all submitted
to the engine loop together so that they batch into the same steps and the n samples of a prompt
share its KV blocks (prefix cache, then cascade attention).  Both endpoints build a ``ChoiceSet``
and read it as one merged stream of per-choice deltas.

A stop string is found here, in the detokenized text (``ray_attn.detokenizer``): the choice is
finished at once and its engine request aborted, so no more of its tokens are computed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

from ray_attn.serve.http import HTTPError, not_taken, request_failed
from ray_attn.serve.loop import Event, LoopDead, QueueFull
from ray_attn.serve.openai.logprobs import LogprobEntry, logprob_entry, token_chars, token_text
from ray_attn.serve.openai.protocol import SamplingFields, unknown_fields
from ray_attn.serve.resume import NOT_RESUMABLE, ResumeContext, choice_progress, progress_line
from ray_attn.serve.schemas import out_of_vocab, prompt_errors, validation_errors

_MASK64 = (1 << 64) - 1
log = logging.getLogger("ray.serve")


def choice_seed(seed: Optional[int], j: int) -> Optional[int]:
    """Sample j's seed: the request's own for j = 0 (so n=1 draws what /v1/generate draws), else a
    splitmix64 mix of (seed, j) -- independent streams, fixed by (seed, j) alone."""
    if seed is None or j == 0:
        return seed
    x = (seed + j * 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & (2**63 - 1)


def sampling_params(req: SamplingFields, max_tokens: int, num_logprobs: Optional[int], seed: Optional[int],
                    prompt_logprobs: Optional[int] = None, structured=None):
    """The engine's SamplingParams for one choice; a value it refuses is a 400 naming the field."""
    from ray_attn.request import SamplingParams

    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k, min_p=req.min_p,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty, seed=seed,
            stop_token_ids=tuple(req.stop_token_ids or ()), min_tokens=req.min_tokens,
            ignore_eos=req.ignore_eos, logprobs=num_logprobs, logit_bias=req.logit_bias_items(),
            prompt_logprobs=prompt_logprobs, structured_outputs=structured)
    except ValueError as e:
        msg = str(e)
        raise HTTPError(400, [(msg.split(" ", 1)[0], msg)]) from None


@dataclass
class Choice:
    index: int
    prompt_index: int
    prompt_ids: list[int]
    params: object
    detok: object = None  # IncrementalDetokenizer when the server has a tokenizer
    rid: Optional[str] = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobEntry] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: object = None
    error: Optional[str] = None
    accepted: bool = False
    num_cached_tokens: int = 0  # its prompt tokens that were prefix-cache hits
    # the next logprobs entry's offset: the token strings' lengths so far (vLLM's text_offset),
    # carried on across stream chunks and a resume so that streamed offsets equal the whole answer's
    text_offset: int = 0
    prompt_logprobs: Optional[list] = None  # TokenLogprobs per prompt token (the first None), when asked
    # max_tokens=0 with echo: the engine samples one token (it computes the prompt's logprobs
    # in the step that samples), which is thrown away here
    hidden_output: bool = False

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self.detok.text if self.detok is not None else ""


@dataclass
class Delta:
    """What one choice gained from one engine event."""

    choice: Choice
    text: str
    token_ids: list[int]
    logprobs: list
    finished: bool


class _TaggedSink:
    """Events of one choice into the set's shared queue (called from the engine thread)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, index: int):
        self.loop, self.queue, self.index = loop, queue, index

    def push(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.index, event))
        except RuntimeError:  # the handler's event loop is gone: nobody listens any more
            pass


class ChoiceSet:
    def __init__(self, engine_loop, choices: list[Choice], retry_after_s: int, eos_token_ids=()):
        self.engine_loop = engine_loop
        self.choices = choices
        self.retry = {"Retry-After": str(retry_after_s)}
        self.eos = set(eos_token_ids)
        self.queue: asyncio.Queue = asyncio.Queue()
        self._backlog: deque = deque()

    async def submit(self, resume=None) -> None:
        """Queue every choice, all or none; returns once the engine accepted them all.  With
        ``resume`` (``serve/resume.py``) each choice goes on from the tokens a lost replica
        streamed, and one that had finished is not queued again."""
        loop = asyncio.get_running_loop()
        try:
            for c in self.choices:
                prior = resume.choices.get(c.index) if resume is not None else None
                if prior is not None and self._prime(c, prior):
                    continue
                c.rid = self.engine_loop.submit(c.prompt_ids, c.params, _TaggedSink(loop, self.queue, c.index),
                                                output_token_ids=c.token_ids)
        except (QueueFull, LoopDead) as e:
            self.abort()
            raise not_taken(e, self.retry) from None
        try:
            while not all(c.accepted for c in self.choices):
                idx, ev = await self.queue.get()
                c = self.choices[idx]
                if ev.kind == "accepted":
                    c.accepted = True
                elif ev.kind == "rejected":
                    raise HTTPError(400, [("prompt", f"prompt: {ev.error}")])
                elif ev.kind == "failed":
                    raise request_failed(ev.error, self.retry)
                else:
                    self._backlog.append((idx, ev))
        except BaseException:
            self.abort()
            raise

    @staticmethod
    def _prime(c: Choice, prior) -> bool:
        """Give ``c`` the tokens already streamed, their text taken as sent; True when it had
        finished (nothing to queue)."""
        c.token_ids = list(prior.token_ids)
        if c.params.logprobs is not None:  # the lost stream sent an entry per token
            c.text_offset = token_chars(c, c.token_ids)
        if c.detok is not None and c.token_ids:
            c.detok.add(c.token_ids)
            c.detok.take(final=prior.finished)
        if prior.finished:
            c.finish_reason, c.stop_reason, c.accepted = prior.finish_reason, prior.stop_reason, True
        return prior.finished

    async def deltas(self) -> AsyncIterator[Delta]:
        """Each choice's progress as the engine makes it, until every choice is done."""
        while not all(c.done for c in self.choices):
            idx, ev = self._backlog.popleft() if self._backlog else await self.queue.get()
            c = self.choices[idx]
            if c.done or ev.kind != "tokens":
                continue  # e.g. the abort that follows a stop string
            yield self._advance(c, ev)

    def _advance(self, c: Choice, ev: Event) -> Delta:
        c.num_cached_tokens = getattr(ev, "num_cached_tokens", 0)
        if getattr(ev, "prompt_logprobs", None) is not None:
            c.prompt_logprobs = ev.prompt_logprobs
        if c.hidden_output:
            if ev.finished:
                c.finish_reason, c.error = ("length" if ev.finish_reason in ("length", "stop")
                                            else ev.finish_reason or "error"), ev.error
            return Delta(c, "", [], [], c.done)
        new_ids: list[int] = []
        new_lps: list = []
        lps = getattr(ev, "logprobs", None) or [None] * len(ev.token_ids)
        stopped = False
        for t, lp in zip(ev.token_ids, lps):
            if c.detok is not None:
                stopped = c.detok.add([t])
            c.token_ids.append(t)
            new_ids.append(t)
            if lp is not None:
                entry = logprob_entry(c, lp, c.text_offset)
                c.text_offset += len(entry.token)
                c.logprobs.append(entry)
                new_lps.append(entry)
            if stopped:
                break
        if stopped:
            self.engine_loop.abort(c.rid)
            c.finish_reason, c.stop_reason = "stop", c.detok.stop_reason
        elif ev.finished:
            c.finish_reason, c.error = ev.finish_reason or "error", ev.error
            if c.finish_reason == "stop" and c.token_ids and c.token_ids[-1] not in self.eos:
                c.stop_reason = c.token_ids[-1]  # a stop token id (EOS reports null, as vLLM)
            if c.detok is not None:
                c.detok.finish()
        text = c.detok.take(final=c.done) if c.detok is not None else ""
        return Delta(c, text, new_ids, new_lps, c.done)

    token_text = staticmethod(token_text)

    async def collect(self) -> list[Choice]:
        async for _ in self.deltas():
            pass
        return self.choices

    def abort(self) -> None:
        """End every unfinished choice (the client left, or one choice could not be queued)."""
        for c in self.choices:
            if c.rid is not None and not c.done:
                self.engine_loop.abort(c.rid)

    def raise_if_failed(self) -> None:
        """A choice ended by a server-side failure makes the whole answer a 503 the client may retry."""
        for c in self.choices:
            if c.finish_reason == "error":
                raise request_failed(c.error, self.retry)

    def usage(self) -> dict:
        prompts = {c.prompt_index: len(c.prompt_ids) for c in self.choices}
        # A prompt counts once, like prompt_tokens: its hits are those of its least lucky sample
        # (the n samples of a prompt admitted together hit the blocks the first one computes).
        cached: dict[int, int] = {}
        for c in self.choices:
            cached[c.prompt_index] = min(cached.get(c.prompt_index, c.num_cached_tokens), c.num_cached_tokens)
        done = sum(len(c.token_ids) for c in self.choices)
        return {"prompt_tokens": sum(prompts.values()), "completion_tokens": done,
                "total_tokens": sum(prompts.values()) + done,
                "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}


# ---------------------------------------------------------------------- what both endpoints check
def parse(model, body: bytes, strict: bool = False):
    """The body as ``model``; every problem a 400 naming its field (OpenAI answers 400 here).
    A field no model declares is logged and ignored (vLLM's behaviour: clients send fields of
    newer API versions and of other servers), or with ``strict`` (``strict_request_fields``) a
    400 naming it."""
    from pydantic import ValidationError

    try:
        req = model.model_validate_json(body)
    except ValidationError as e:
        errs = validation_errors(e, model)
        if strict:  # the unknown top-level keys too, as a forbidding model would list them
            errs = _unknown_keys(body, model) + errs
        raise HTTPError(400, errs) from None
    unknown = unknown_fields(req)
    if unknown and strict:
        raise HTTPError(400, [(f, f"{f}: unknown field (allowed: {', '.join(m.model_fields)})")
                              for f, m in unknown[:8]])
    if unknown:
        # bounded: a body may hold thousands of made-up names
        names = ", ".join(f[:64] for f, _ in unknown[:8]) + (f" and {len(unknown) - 8} more"
                                                             if len(unknown) > 8 else "")
        log.warning("The following fields were present in the request but ignored: %s", names)
    return req


def _unknown_keys(body: bytes, model, limit: int = 16) -> list[tuple[str, str]]:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return []
    if not isinstance(obj, dict):
        return []
    names = [k for k in obj if k not in model.model_fields][:limit]
    return [(k, f"{k}: unknown field (allowed: {', '.join(model.model_fields)})") for k in names]


def check_model(server, name: Optional[str]) -> None:
    """The served model, or one of its adapters (``model="<adapter>"`` / ``"<model>:<adapter>"``,
    serve/lora_adapters.py): the request then runs under it."""
    adapters = getattr(server, "adapters", None)
    if adapters is not None:
        adapters.resolve(name)
        return
    if name is not None and name != server.model_id:
        raise HTTPError(404, [("model", f"model: '{name[:128]}' does not exist; this server serves "
                                        f"'{server.model_id}' (GET /v1/models)")])


def check_prompt(server, ids: list[int], field: str) -> None:
    errs = prompt_errors(ids, field, server.cfg.max_prompt_tokens, server.vocab_size)
    if errs:
        raise HTTPError(400, errs)


def resolve_max_tokens(server, asked: Optional[int], prompt_len: int, field: str) -> int:
    """``asked``, checked against the server's limit and the context; unset (chat), as many as
    both allow."""
    limit, ctx = server.cfg.max_tokens_limit, server.max_model_len
    room = ctx - prompt_len
    if asked is None:
        if room < 1:
            raise HTTPError(400, [(field, f"{field}: a prompt of {prompt_len} tokens leaves no room in "
                                          f"the model's {ctx}-token context")])
        return min(limit, room)
    if asked > limit:
        raise HTTPError(400, [(field, f"{field}: {asked} exceeds the limit of {limit} (max_tokens_limit)")])
    if asked > room:
        raise HTTPError(400, [(field, f"{field}: prompt of {prompt_len} tokens + {field}={asked} "
                                      f"exceeds the model's {ctx}-token context")])
    return asked


def build_choices(server, req: SamplingFields, prompts: list[list[int]], max_tokens: list[int],
                  num_logprobs: Optional[int], prompt_logprobs: Optional[int] = None,
                  structured=None) -> ChoiceSet:
    """prompts x n choices, index = prompt index x n + sample index (OpenAI's order).  A
    ``max_tokens`` of 0 (echo) samples one token that no answer shows."""
    cfg = server.cfg
    stops, stop_ids = req.stop_strings(), req.stop_token_ids or []
    for name, values in (("stop", stops), ("stop_token_ids", stop_ids)):
        if len(values) > cfg.max_stop_token_ids:
            raise HTTPError(400, [(name, f"{name}: {len(values)} entries exceeds the limit of "
                                         f"{cfg.max_stop_token_ids} (max_stop_token_ids)")])
    bad = out_of_vocab(stop_ids, "stop_token_ids", server.vocab_size)
    bad += [("logit_bias", f"logit_bias: token id {t} is outside the vocabulary [0, {server.vocab_size})")
            for t, _ in req.logit_bias_items() if t >= server.vocab_size][:1]
    if bad:
        raise HTTPError(400, bad[:1])
    if stops and server.tokenizer is None:
        raise HTTPError(400, [("stop", "stop: stop strings need a tokenizer on the server (app config "
                                       "'tokenizer'); use stop_token_ids")])
    if len(prompts) * req.n > cfg.max_choices:
        raise HTTPError(400, [("n", f"n: {len(prompts)} prompt(s) x n={req.n} choices exceeds the "
                                    f"limit of {cfg.max_choices} (max_choices)")])
    choices = []
    for p, (ids, mt) in enumerate(zip(prompts, max_tokens)):
        for j in range(req.n):
            detok = None
            if server.tokenizer is not None:
                from ray_attn.detokenizer import IncrementalDetokenizer

                detok = IncrementalDetokenizer(server.tokenizer, ids, stops, req.include_stop_str_in_output,
                                               req.skip_special_tokens)
            params = sampling_params(req, max(mt, 1), num_logprobs, choice_seed(req.seed, j), prompt_logprobs,
                                     structured)
            choices.append(Choice(len(choices), p, ids, params, detok, hidden_output=mt == 0))
    return ChoiceSet(server.loop, choices, cfg.retry_after_s, server.eos_token_ids)


def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def sse_error(e: HTTPError) -> str:
    """An error after the stream began (the status is already 200): vLLM's in-stream error event."""
    return sse(e.body())


def stream_response(choices: ChoiceSet, req: SamplingFields, head: dict, chunk, rid: str, opening=(),
                    ctx: ResumeContext = NOT_RESUMABLE):
    """The SSE answer: ``opening`` chunks, then ``chunk(delta)`` per delta that carries something,
    an in-stream error if a choice failed, the usage chunk when asked, and ``[DONE]``.  A client
    that leaves mid-stream aborts every choice.  For the front (``ctx``, ``serve/resume.py``)
    each message also carries its progress line; a resumed stream keeps the lost one's id and
    created time and sends neither the opening nor a usage chunk again."""
    opts = req.stream_options
    include_usage, every = (opts.include_usage, opts.continuous_usage_stats) if opts else (False, False)
    if ctx.resume is not None:
        head, opening = dict(head, **ctx.resume.head), ()
        rid = head.get("id", rid)

    async def events():
        finished = False
        try:
            first = "".join(sse(dict(head, choices=[ch], usage=None)) for ch in opening)
            if ctx.resumable and ctx.resume is None:  # the head in the same message as the opening
                first = progress_line(head={"id": head["id"], "created": head["created"]}) + first
            if first:
                yield first
            async for d in choices.deltas():
                if d.text or d.token_ids or d.finished:
                    try:
                        ch = chunk(d)
                    except HTTPError as e:  # a choice with no answer to give (a forced tool call
                        yield sse_error(e)  # that does not parse): the stream ends with the error
                        choices.abort()
                        break
                    line = sse(dict(head, choices=[ch], usage=choices.usage() if every else None))
                    c = d.choice
                    if ctx.resumable:  # an error end is not progress: a resumed request may finish
                        reason = c.finish_reason if d.finished and c.finish_reason != "error" else None
                        line = choice_progress(c.index, d.token_ids, reason, c.stop_reason if reason else None) + line
                    yield line
            try:
                choices.raise_if_failed()
            except HTTPError as e:
                yield sse_error(e)
            if include_usage and not (ctx.resume is not None and ctx.resume.usage_sent):
                usage = sse(dict(head, choices=[], usage=choices.usage()))
                yield (progress_line(u=True) + usage) if ctx.resumable else usage
            yield "data: [DONE]\n\n"
            finished = True
        finally:
            if not finished:
                choices.abort()

    from fastapi.responses import StreamingResponse

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Request-Id": rid})


async def finish(choices: ChoiceSet) -> list[Choice]:
    """Every choice to its end (non-streaming); a server-side failure is a 503."""
    try:
        await choices.collect()
    finally:
        choices.abort()  # a no-op when all finished; frees the blocks of a client that left
    choices.raise_if_failed()
    return choices.choices
