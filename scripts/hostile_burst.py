#!/usr/bin/env python
"""A burst of concurrent requests from many client addresses, and /health polled throughout.

Every answer is sorted into: served (200 with a complete body or stream), ours (our JSON error
body, with ``Retry-After`` on 503/429) or foreign (anything else: Serve's own plain-text 503, a
dropped connection, a cut stream).  Meanwhile the app's ``/health`` and Serve's proxy's own
``/-/healthz`` are asked every ``--health-every`` seconds, each ask on a fresh connection from a
process of its own, and their latencies recorded: the proxy's says what any route through it
waits on this machine, the app's what the replica adds.  Client addresses are
127.0.0.x source addresses (all of 127/8 is loopback), so the per-client bound sees many clients::

    serve run deploy/serve_config.yaml &
    python scripts/hostile_burst.py --requests 1000 --addresses 50 --check

Each poller's latencies are summarised over the asks that overlapped the burst (from its first
request to its last answer): percentiles (p50, p90, p99, max) and how many took longer than
``--health-deadline``; an idle ask before or after the burst says nothing about it.  A third
poller asks ``--control-path`` (``/stats``: a replica route that awaits nothing), so that what
/health adds of its own is told apart from what every route of the replica waits.

With ``--api-key`` the burst carries no key -- every answer should be our 401 -- while a client
with the key asks one short generation after another: alone for ``--idle-s`` first, then through
the burst (issue 42: its p99 within ``--keyed-p99-ratio`` of the idle run's)::

    python scripts/hostile_burst.py --api-key "$KEY" --requests 1000 --addresses 50 --check

With ``--check`` it exits 1 when any answer is foreign or a /health took longer than
``--health-deadline`` (or failed), or, keyed, the keyed client failed or its p99 grew too much.  Writes the counts as JSON (``--output``).
The run is bounded: every request has ``--timeout``, and the poller stops when the burst ends.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import sys
import time
from collections import Counter
from contextlib import nullcontext
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
    health_polls: list = field(default_factory=list)  # (wall time sent, latency s), answered 200

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


def poll_health(url: str, every: float, ready, stop, timeout: float, results, key: str = "",
                max_tokens: int = 4, generate: bool = False, keepalive: bool = False) -> None:
    """GET ``url`` every ``every`` s on a fresh connection (``keepalive``: on one kept-alive
    connection, as a pooled client such as the openai SDK's holds one) until ``stop`` is set; put
    ``(polls, failures)`` on ``results``, a poll being (wall time sent, latency) of a 200.  It
    runs in a process of its own: in the burst's event loop it would wait behind 400 coroutines,
    and what it timed would be this client's loop, not the server (a 2-core CI box saw 2 asks in
    3.7 s, one of them 2.7 s).  ``key`` goes as ``Authorization: Bearer <key>``; with
    ``generate`` each ask is a ``max_tokens`` generation POSTed to ``url`` instead of a GET."""
    polls, failures = [], 0
    body = {"prompt_token_ids": [1, 2, 3, 4], "max_tokens": max_tokens, "ignore_eos": True}
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    kept = httpx.Client(timeout=timeout) if keepalive else None
    ready.set()
    while not stop.is_set():
        sent, t0 = time.time(), time.perf_counter()
        try:
            # the kept client stays open; else a fresh one (a fresh connection) each time
            with nullcontext(kept) if kept is not None else httpx.Client(timeout=timeout) as c:
                r = c.post(url, json=body, headers=auth) if generate else c.get(url, headers=auth)
            if r.status_code == 200:
                polls.append((sent, time.perf_counter() - t0))
            else:
                failures += 1
        except httpx.HTTPError:
            failures += 1
        stop.wait(every)
    if kept is not None:
        kept.close()
    results.put((polls, failures))


def percentile(values: list, q: float):
    """The ``q``-quantile (0..1) by nearest rank; None for no values."""
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v) - 1e-9) - 1))]


def latency_summary(polls: list, start: float, end: float, deadline: float) -> dict:
    """The asks that overlapped [start, end] (wall times): their count, percentiles and how many
    took longer than ``deadline``."""
    during = [lat for sent, lat in polls if sent <= end and sent + lat >= start]
    out = {"n": len(during), "over_deadline": sum(lat > deadline for lat in during)}
    for name, q in (("p50_s", 0.5), ("p90_s", 0.9), ("p99_s", 0.99), ("max_s", 1.0)):
        x = percentile(during, q)
        out[name] = None if x is None else round(x, 3)
    return out


async def burst(url: str, requests: int, addresses: int, first_address: int, stream_share: float,
                max_tokens: int, timeout: float) -> tuple[Outcome, float, float]:
    """The burst's outcome, its wall time and the wall time it began."""
    out = Outcome()
    per = -(-requests // addresses)
    clients = [httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(local_address=f"127.0.0.{first_address + a}"),
                                 timeout=timeout, limits=httpx.Limits(max_connections=per + 1))
               for a in range(addresses)]
    began, t0 = time.time(), time.perf_counter()
    try:
        await asyncio.gather(*[one_request(clients[i % addresses], url, (i % 100) < stream_share * 100,
                                           max_tokens, out) for i in range(requests)])
    finally:
        wall = time.perf_counter() - t0
        for c in clients:
            await c.aclose()
    return out, wall, began


def proxy_health_url(url: str) -> str:
    """Serve's proxy's own health route, which no replica sees: the same host, ``/-/healthz``."""
    u = httpx.URL(url)
    return str(u.copy_with(path="/-/healthz", query=None))


def keyed_alone(url: str, key: str, seconds: float, max_tokens: int, timeout: float, keepalive: bool = False) -> list:
    """The authenticated client's asks over ``seconds`` with no burst: its idle latencies."""
    ctx = multiprocessing.get_context("spawn")
    stop, ready, results = ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=poll_health, args=(url + "/v1/generate", 0.0, ready, stop, timeout, results, key,
                                                 max_tokens, True, keepalive), daemon=True)
    proc.start()
    if not ready.wait(timeout):
        raise RuntimeError(f"the keyed client did not start within {timeout} s")
    time.sleep(seconds)
    stop.set()
    polls, _ = results.get(timeout=timeout + 30)
    proc.join(timeout=30)
    return polls


def burst_with_health(url: str, requests: int, addresses: int, first_address: int, stream_share: float,
                      max_tokens: int, timeout: float, health_every: float,
                      control_path: str = "", key: str = "", burst_nice: int = 0, keyed_keepalive: bool = False
                      ) -> tuple[Outcome, float, float, tuple, tuple, tuple]:
    """The burst, with pollers in spawned processes from before the first request until after
    the last answer: the app's ``/health``, Serve's proxy's ``/-/healthz`` and, with
    ``control_path``, an app route that awaits nothing (``/stats``).  The proxy's says how long
    any route through the proxy waits on this machine during the burst, the control's how long
    any route of the replica does: what /health adds of its own is the difference."""
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    pollers = []
    # (url, key, generate): the control route is keyed too when the server is (/stats needs one)
    targets = [(url + "/health", "", False), (proxy_health_url(url), "", False)] \
        + ([(url + control_path, key, False)] if control_path else []) \
        + ([(url + "/v1/generate", key, True)] if key else [])
    for target, k, gen in targets:
        ready, results = ctx.Event(), ctx.Queue()
        proc = ctx.Process(target=poll_health, args=(target, 0.0 if gen else health_every, ready, stop, timeout,
                                                     results, k, max_tokens, gen, gen and keyed_keepalive), daemon=True)
        proc.start()
        pollers.append((proc, ready, results))
    try:
        for _, ready, _ in pollers:
            if not ready.wait(timeout):
                raise RuntimeError(f"a health poller did not start within {timeout} s")
        if burst_nice:  # this process only (the burst), not the pollers started above
            os.nice(burst_nice)
        out, wall, began = asyncio.run(burst(url, requests, addresses, first_address, stream_share, max_tokens,
                                             timeout))
    finally:
        stop.set()
    # A poller's last ask may still be in flight: it ends within one request timeout.
    polled = [results.get(timeout=timeout + 30) for _, _, results in pollers]
    for proc, _, _ in pollers:
        proc.join(timeout=30)
    out.health_polls, out.health_failures = polled[0]
    out.health_s = [lat for _, lat in out.health_polls]
    return (out, wall, began, polled[1], (polled[2] if control_path else ([], 0)),
            (polled[-1] if key else ([], 0)))


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
    ap.add_argument("--control-path", default="/stats",
                    help="an app route that awaits nothing, polled beside /health ('' for none)")
    ap.add_argument("--output", default=str(REPO / "benchmarks/results/hostile_burst.json"))
    ap.add_argument("--api-key", default="", help="the server's API key: the burst then carries none (a flood "
                    "of 401s) while a client with the key asks one generation after another, alone for "
                    "--idle-s first, then during the burst; its p99 during / alone is reported")
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--keyed-p99-ratio", type=float, default=1.2, help="--check: the most the keyed p99 may grow")
    ap.add_argument("--burst-nice", type=int, default=0, help=(
        "lower the burst's own CPU priority by this much (os.nice), so that its client takes little of "
        "the cores the server runs on, as a flood from other machines would: 19 for that; 0 (default): "
        "the flood's client competes with the server for this machine's cores"))
    ap.add_argument("--keyed-keepalive", action="store_true", help=(
        "the keyed client keeps one connection alive for all its asks (as the openai SDK's pool does), "
        "alone and through the burst; by default each ask opens a fresh one"))
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args(argv)
    if not 1 <= a.addresses <= 250 - a.first_address + 1:
        ap.error("--addresses: the source addresses must stay within 127.0.0.1-250")
    idle = keyed_alone(a.url, a.api_key, a.idle_s, a.max_tokens, a.timeout, a.keyed_keepalive) if a.api_key else []
    out, wall, began, (proxy_polls, proxy_failures), (control_polls, control_failures), (keyed_polls, keyed_failures) = \
        burst_with_health(a.url, a.requests, a.addresses, a.first_address, a.stream_share, a.max_tokens, a.timeout,
                          a.health_every, a.control_path, a.api_key, a.burst_nice, a.keyed_keepalive)
    keyed = {}
    if a.api_key:
        alone = latency_summary(idle, 0.0, math.inf, a.timeout)
        during = latency_summary(keyed_polls, began, began + wall, a.timeout)
        ratio = (during["p99_s"] / alone["p99_s"]) if during["p99_s"] and alone["p99_s"] else None
        keyed = dict(keyed_alone=alone, keyed_during_burst=during, keyed_failures=keyed_failures,
                     keyed_p99_ratio=None if ratio is None else round(ratio, 3), keyed_p99_ratio_goal=a.keyed_p99_ratio)
    worst = max(out.health_s, default=None)
    proxy_s = [lat for _, lat in proxy_polls]
    report = dict(requests=a.requests, addresses=a.addresses, stream_share=a.stream_share, burst_nice=a.burst_nice, keyed_keepalive=a.keyed_keepalive,
                  wall_s=round(wall, 2), **dict(sorted(out.counts.items())), foreign=out.num_foreign,
                  health_checks=len(out.health_s), health_failures=out.health_failures,
                  health_max_s=None if worst is None else round(worst, 3),
                  health_during_burst=latency_summary(out.health_polls, began, began + wall, a.health_deadline),
                  proxy_health_checks=len(proxy_s), proxy_health_failures=proxy_failures,
                  proxy_health_max_s=round(max(proxy_s), 3) if proxy_s else None,
                  proxy_health_during_burst=latency_summary(proxy_polls, began, began + wall, a.health_deadline),
                  **({"control_path": a.control_path, "control_failures": control_failures,
                      "control_during_burst": latency_summary(control_polls, began, began + wall, a.health_deadline)}
                     if a.control_path else {}),
                  **keyed, foreign_samples=out.samples)
    print(json.dumps(report, indent=2))
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(report, indent=2) + "\n")
    bad = out.num_foreign or out.health_failures or proxy_failures or control_failures \
        or (worst is not None and worst > a.health_deadline) \
        or not out.health_s \
        or (a.api_key and (keyed_failures or not keyed.get("keyed_p99_ratio")
                           or keyed["keyed_p99_ratio"] > a.keyed_p99_ratio))
    return 1 if a.check and bad else 0


if __name__ == "__main__":
    sys.exit(main())
