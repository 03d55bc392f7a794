"""Send a workload through a transport on vLLM's arrival schedule, bounded in concurrency.

A transport is an async callable ``send(SampleRequest) -> RequestFuncOutput`` that never raises
for a failed request (it records the error).  The schedule is vLLM's: every request at time 0 for
an infinite rate, else gamma-distributed gaps of mean ``1 / rate`` (shape ``burstiness``; 1 is a
Poisson process), rescaled so that the last request starts at ``n / rate`` -- the rescaling keeps
the offered load the same across seeds.  ``max_concurrency`` bounds the requests in flight
(a request waits for a slot after its arrival, so the achieved rate can fall below the asked one).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Awaitable, Callable, Sequence

import numpy as np

from .datasets import SampleRequest
from .metrics import RequestFuncOutput

Send = Callable[[SampleRequest], Awaitable[RequestFuncOutput]]


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float,
                    rng: np.random.Generator) -> list[float]:
    """Seconds after the start at which each request is sent."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if request_rate == float("inf"):
        return [0.0] * num_requests
    if burstiness == float("inf"):
        gaps = np.full(num_requests, 1.0 / request_rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)
    t = np.cumsum(gaps)
    return (t * (num_requests / request_rate) / t[-1]).tolist()


async def run_requests(send: Send, requests: Sequence[SampleRequest], request_rate: float,
                       burstiness: float, max_concurrency: int | None, rng: np.random.Generator,
                       disable_tqdm: bool = False) -> tuple[list[RequestFuncOutput], float]:
    """Every request's output, in input order, and the run's duration in seconds."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {max_concurrency}")
    offsets = arrival_offsets(len(requests), request_rate, burstiness, rng)
    from tqdm.auto import tqdm

    bar = tqdm(total=len(requests), disable=disable_tqdm, desc="requests")
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()

    async def limited(req: SampleRequest) -> RequestFuncOutput:
        async with slots:
            out = await send(req)
        bar.update(1)
        return out

    start = time.perf_counter()
    tasks = []
    for req, at in zip(requests, offsets):
        wait = start + at - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(limited(req)))
    outputs = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()
    return list(outputs), duration


async def warmup(send: Send, request: SampleRequest, num_warmups: int,
                 max_concurrency: int | None) -> list[RequestFuncOutput]:
    """``num_warmups`` copies of one request, not measured (vLLM's ``--num-warmups``)."""
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()

    async def one() -> RequestFuncOutput:
        async with slots:
            return await send(request)

    return list(await asyncio.gather(*[one() for _ in range(num_warmups)]))
