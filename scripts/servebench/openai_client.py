"""The HTTP transport: OpenAI ``/v1/completions`` with streaming, as ``vllm bench serve`` sends it.

The request is ``stream: true`` with ``stream_options.include_usage`` and greedy decoding; the
prompt is a list of token ids (the completions API accepts one), so no tokenizer is needed.  The
response is server-sent events, ``data: {...}`` then ``data: [DONE]``.  A *token chunk* is one
whose ``choices[0]`` carries text or token ids, or carries nothing and no ``finish_reason`` (a
token that decodes to no text); a closing chunk with only a ``finish_reason``, and the ``usage``
chunk (empty ``choices``), are not tokens.  TTFT is the first token chunk, ITL the gaps between
them; the output length comes from ``usage.completion_tokens`` (one chunk may hold several).
"""

from __future__ import annotations

import asyncio
import json
import time

from .datasets import SampleRequest
from .metrics import RequestFuncOutput

TIMEOUT_S = 6 * 60 * 60


class SSEDecoder:
    """Server-sent events from lines: ``data:`` lines accumulate until a blank line ends the
    event; comments (``:``) and other fields are skipped."""

    def __init__(self):
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        line = line.rstrip("\r\n")
        if not line:
            return self.flush()
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


def is_token_chunk(choice: dict) -> bool:
    if choice.get("text") or choice.get("token_ids"):
        return True
    return choice.get("finish_reason") is None


def build_payload(model: str, req: SampleRequest, ignore_eos: bool, extra_body: dict | None) -> dict:
    payload = {"model": model, "prompt": req.prompt, "max_tokens": req.expected_output_len,
               "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:  # sent only when set, as vLLM does: a plain OpenAI server does not know it
        payload["ignore_eos"] = True
    payload.update(extra_body or {})
    return payload


async def request_completions(session, api_url: str, payload: dict, prompt_len: int) -> RequestFuncOutput:
    out = RequestFuncOutput(prompt_len=prompt_len)
    st = out.start_time = time.perf_counter()
    last, first, token_ids = st, None, []
    try:
        async with session.post(api_url, json=payload) as resp:
            if resp.status != 200:
                body = (await resp.text())[:500]
                out.error = f"HTTP {resp.status} {resp.reason}: {body}"
                return out
            sse = SSEDecoder()
            async for raw in resp.content:
                data = sse.feed(raw.decode("utf-8", errors="replace"))
                if data is None or data == "[DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = f"error event: {json.dumps(chunk['error'])[:500]}"
                    return out
                choices = chunk.get("choices") or []
                if choices:
                    choice = choices[0]
                    if is_token_chunk(choice):
                        if first is None:
                            first = out.ttft = now - st
                        else:
                            out.itl.append(now - last)
                        last = now
                        token_ids += choice.get("token_ids") or []
                    if choice.get("finish_reason") == "error":
                        out.error = f"finish_reason=error: {chunk.get('error') or choice}"[:500]
                        return out
                if chunk.get("usage"):
                    out.output_tokens = int(chunk["usage"].get("completion_tokens") or 0)
        if first is None:
            out.error = "the stream carried no token chunk"
            return out
        out.latency = last - st
        out.output_token_ids = token_ids or None
        out.success = True
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - a failed request is recorded, never ends the run
        out.error = f"{type(e).__name__}: {e}"[:500]
    return out


class OpenAICompletionsTransport:
    """One aiohttp session for the run; ``send`` is the driver's transport."""

    def __init__(self, api_url: str, model: str, ignore_eos: bool, extra_body: dict | None = None,
                 headers: dict | None = None):
        import aiohttp

        self.api_url, self.model, self.ignore_eos, self.extra_body = api_url, model, ignore_eos, extra_body
        # As vLLM: no keep-alive (each request opens its connection).  No connection cap: the
        # driver's --max-concurrency bound is the one both transports share.
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        self.session = aiohttp.ClientSession(connector=connector, headers=headers or {},
                                             timeout=aiohttp.ClientTimeout(total=TIMEOUT_S))

    async def send(self, req: SampleRequest) -> RequestFuncOutput:
        payload = build_payload(self.model, req, self.ignore_eos, self.extra_body)
        return await request_completions(self.session, self.api_url, payload, req.prompt_len)

    async def ready(self, req: SampleRequest, timeout_s: float) -> RequestFuncOutput:
        """Send one request until it succeeds or ``timeout_s`` passes (vLLM's ready check)."""
        deadline = time.monotonic() + timeout_s
        while True:
            out = await self.send(req)
            if out.success or time.monotonic() >= deadline:
                return out
            await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    async def close(self) -> None:
        await self.session.close()


async def server_info(base_url: str) -> dict:
    """What the server says of its model: ``id`` and ``vocab_size`` (and ``max_model_len``) from
    ``GET /v1/models``; our app's ``GET /stats`` also has ``vocab_size``.  Missing keys stay out."""
    import aiohttp

    info: dict = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        for path in ("/v1/models", "/stats"):
            try:
                async with s.get(base_url + path) as r:
                    if r.status != 200:
                        continue
                    body = await r.json(content_type=None)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                continue
            models = body.get("data") if isinstance(body, dict) else None
            entry = models[0] if isinstance(models, list) and models and isinstance(models[0], dict) else body
            if not isinstance(entry, dict):
                continue
            for key in ("id", "vocab_size", "max_model_len"):
                if key in entry and key not in info and (key != "id" or path == "/v1/models"):
                    info[key] = entry[key]
    return info
