"""A fake OpenAI completions server on loopback, for the serving benchmark's tests.

It streams ``max_tokens`` tokens as server-sent events with the delays a test chooses per
request, counts the requests it holds at once, and can answer some requests with HTTP 500.  The
stream has what real servers send and a client must get right: a comment line, one SSE message
split over two writes, a last chunk that carries two tokens (so chunks != tokens and only
``usage`` gives the count), a closing chunk with just a ``finish_reason``, the ``usage`` chunk
with empty ``choices``, and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from typing import Callable

from aiohttp import web
from tests.timescale import scaled


@dataclass
class Plan:
    """How the fake answers one request."""

    first_delay: float = 0.0  # seconds from the response headers to the first token
    gap: float = 0.0  # seconds between token chunks
    status: int = 200


@dataclass
class FakeOpenAI:
    plan: Callable[[dict], Plan] = lambda body: Plan()
    vocab_size: int = 64
    model: str = "fake-model"
    bodies: list[dict] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    url: str = ""

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "vocab_size": self.vocab_size, "max_model_len": 4096}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            plan = self.plan(body)
            if plan.status != 200:
                await asyncio.sleep(plan.first_delay)
                return web.json_response({"error": {"message": "injected failure"}}, status=plan.status)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b": keep-alive comment\n\n")
            n = body["max_tokens"]
            texts = [f" t{i}" for i in range(n)]
            if n >= 2:  # the last chunk carries two tokens
                texts[-2:] = [texts[-2] + texts[-1]]
            await asyncio.sleep(plan.first_delay)
            for i, text in enumerate(texts):
                if i:
                    await asyncio.sleep(plan.gap)
                msg = "data: " + json.dumps({"id": "cmpl-1", "object": "text_completion", "choices": [
                    {"index": 0, "text": text, "finish_reason": None}]}) + "\n\n"
                if i == 0:  # one message in two writes: the client must wait for its end
                    await resp.write(msg[:10].encode())
                    await asyncio.sleep(0.001)
                    msg = msg[10:]
                await resp.write(msg.encode())
            tail = [{"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
                    {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n,
                                              "total_tokens": len(body["prompt"]) + n}}]
            for chunk in tail:
                await resp.write(("data: " + json.dumps(chunk) + "\n\n").encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            self.in_flight -= 1

    def __enter__(self) -> "FakeOpenAI":
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        async def start():
            app = web.Application()
            app.router.add_get("/v1/models", self.models)
            app.router.add_post("/v1/completions", self.completions)
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]
            self.url = f"http://127.0.0.1:{port}"
            ready.set()

        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(start(), self._loop)
        assert ready.wait(scaled(10)), "the fake server did not start"
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
