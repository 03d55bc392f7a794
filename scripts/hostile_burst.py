#!/usr/bin/env python
"""A burst of concurrent requests from many client addresses, and /health polled throughout.

Every answer is sorted into: served (200 with a complete body or stream), ours (our JSON error
body, with ``Retry-After`` on 503/429) or foreign (anything else: Serve's own plain-text 503, a
dropped connection, a cut stream).  Meanwhile ``/health`` is asked every ``--health-every``
seconds, each ask on a fresh connection, and its latency recorded.  Client addresses are
127.0.0.x source addresses (all of 127/8 is loopback), so the per-client bound sees many clients::

    serve run deploy/serve_config.yaml &
    python scripts/hostile_burst.py --requests 1000 --addresses 50 --check

With ``--check`` it exits 1 when any answer is foreign or a /health took longer than
``--health-deadline`` (or failed).  Writes the counts as JSON (``--output``).
The run is bounded: every request has ``--timeout``, and the poller stops when the burst ends.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Outcome:
    counts: Counter = field(default_factory=Counter)  # served / ours_<status> / foreign_<what>
    samples: list = field(default_factory=list)  # a few foreign answers, for the report
    health_s: list = field(default_factory=list)
    health_failures: int = 0

    def foreign(self, what: str, detail: str) -> None:
        self.counts[f"foreign_{what}"] += 1
        if len(self.samples) < 5:
            self.samples.append(f"{what}: {detail[:200]}")

    @property
    def num_foreign(self) -> int:
        return sum(v for k, v in self.counts.items() if k.startswith("foreign"))


def is_our_error(status: int, headers, body: bytes) -> bool:
    """Our error body (ray_attn/serve/http.py): JSON with ``error``, ``detail`` and ``field``, and
    ``Retry-After`` on a 503 or 429."""
    if not headers.get("content-type", "").startswith("application/json"):
        return False
    try:
        err = json.loads(body)
    except ValueError:
        return False
    if not isinstance(err, dict) or not {"error", "detail", "field"} <= err.keys():
        return False
    return status not in (429, 503) or "retry-after" in headers


async def one_request(client: httpx.AsyncClient, url: str, stream: bool, max_tokens: int, out: Outcome):
    body = {"prompt_token_ids": [1, 2, 3, 4], "max_tokens": max_tokens, "stream": stream}
    try:
        async with client.stream("POST", url + "/v1/generate", json=body) as r:
            raw = await r.aread()
            if r.status_code != 200:
                if is_our_error(r.status_code, r.headers, raw):
                    out.counts[f"ours_{r.status_code}"] += 1
                else:
                    out.foreign(str(r.status_code), raw.decode("utf-8", "replace"))
                return
            text = raw.decode()
            done = ('"finish_reason"' in text) if stream else bool(json.loads(text).get("token_ids"))
            if done:
                out.counts["served"] += 1
            else:
                out.foreign("cut_stream" if stream else "empty", text[-200:])
    except (httpx.HTTPError, ValueError) as e:
        out.foreign(type(e).__name__, repr(e))


async def poll_health(url: str, every: float, stop: asyncio.Event, out: Outcome, timeout: float):
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            async with httpx.AsyncClient(timeout=timeout) as c:  # a fresh connection each time
                r = await c.get(url + "/health")
            if r.status_code == 200:
                out.health_s.append(time.perf_counter() - t0)
            else:
                out.health_failures += 1
        except httpx.HTTPError:
            out.health_failures += 1
        try:
            await asyncio.wait_for(stop.wait(), every)
        except asyncio.TimeoutError:
            pass


async def burst(url: str, requests: int, addresses: int, first_address: int, stream_share: float,
                max_tokens: int, timeout: float, health_every: float) -> tuple[Outcome, float]:
    out = Outcome()
    per = -(-requests // addresses)
    clients = [httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(local_address=f"127.0.0.{first_address + a}"),
                                 timeout=timeout, limits=httpx.Limits(max_connections=per + 1))
               for a in range(addresses)]
    stop = asyncio.Event()
    poller = asyncio.create_task(poll_health(url, health_every, stop, out, timeout))
    t0 = time.perf_counter()
    try:
        await asyncio.gather(*[one_request(clients[i % addresses], url, (i % 100) < stream_share * 100,
                                           max_tokens, out) for i in range(requests)])
    finally:
        wall = time.perf_counter() - t0
        stop.set()
        await poller
        for c in clients:
            await c.aclose()
    return out, wall


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--addresses", type=int, default=50, help="client source addresses 127.0.0.N..")
    ap.add_argument("--first-address", type=int, default=100)
    ap.add_argument("--stream-share", type=float, default=0.5, help="share of requests that stream")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--health-every", type=float, default=0.1)
    ap.add_argument("--health-deadline", type=float, default=1.0)
    ap.add_argument("--output", default=str(REPO / "benchmarks/results/hostile_burst.json"))
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args(argv)
    if not 1 <= a.addresses <= 250 - a.first_address + 1:
        ap.error("--addresses: the source addresses must stay within 127.0.0.1-250")
    out, wall = asyncio.run(burst(a.url, a.requests, a.addresses, a.first_address, a.stream_share,
                                  a.max_tokens, a.timeout, a.health_every))
    worst = max(out.health_s, default=None)
    report = dict(requests=a.requests, addresses=a.addresses, stream_share=a.stream_share,
                  wall_s=round(wall, 2), **dict(sorted(out.counts.items())), foreign=out.num_foreign,
                  health_checks=len(out.health_s), health_failures=out.health_failures,
                  health_max_s=None if worst is None else round(worst, 3), foreign_samples=out.samples)
    print(json.dumps(report, indent=2))
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(report, indent=2) + "\n")
    bad = out.num_foreign or out.health_failures or (worst is not None and worst > a.health_deadline) \
        or not out.health_s
    return 1 if a.check and bad else 0


if __name__ == "__main__":
    sys.exit(main())
