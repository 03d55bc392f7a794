#!/usr/bin/env python
"""Load test of the Serve app: N concurrent clients for T seconds, then a report.

Each client sends ``POST /v1/generate`` requests back to back (random prompts with a shared prefix,
so the prefix cache and cascade attention get exercised) until the deadline.  The run is bounded:
no request starts after ``--duration`` seconds, each has ``--request-timeout``, and the script then
waits (at most ``--drain-timeout``) for the server's in-flight count to reach 0 before it reads the
KV blocks still in use from ``/stats`` -- any left at that point are leaked.

Reports requests completed, errors (by kind), rejections (503, and 429 when one client address
holds the replica's ``max_requests_per_client``; both reported as ``rejected_503``), p50/p99
latency, tokens/s and KV blocks in use at the end; writes them as JSON (default
``benchmarks/results/load_test.json``).
With ``--check`` it exits 1 unless there were 0 errors and 0 leaked blocks::

    serve run deploy/serve_config.yaml &
    python scripts/load_test.py --clients 32 --duration 30 --check
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


class Recorder:
    def __init__(self):
        self.latencies: list[float] = []
        self.ttfts: list[float] = []
        self.tokens = 0
        self.completed = 0
        self.errors: Counter[str] = Counter()
        self.rejected = 0
        self.samples: list[str] = []

    def error(self, kind: str, detail: str) -> None:
        self.errors[kind] += 1
        if len(self.samples) < 10:
            self.samples.append(f"{kind}: {detail[:300]}")


def make_body(rng: random.Random, args, vocab: int, prefixes: list[list[int]]) -> dict:
    prompt = rng.choice(prefixes) + [rng.randrange(vocab) for _ in range(rng.randint(1, args.prompt_len))]
    body = {"prompt_token_ids": prompt, "max_tokens": rng.randint(max(1, args.max_tokens // 2), args.max_tokens)}
    if rng.random() < args.sampled_fraction:
        body.update(temperature=0.8, seed=rng.randrange(1 << 30))
    return body


async def one_request(client: httpx.AsyncClient, body: dict, stream: bool, rec: Recorder, timeout: float):
    t0 = time.perf_counter()
    try:
        if stream:
            body = dict(body, stream=True)
            n, first, finish = 0, None, None
            async with client.stream("POST", "/v1/generate", json=body, timeout=timeout) as r:
                if r.status_code != 200:
                    await r.aread()
                    return r.status_code, r.text, t0
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    if first is None and ev["token_ids"]:
                        first = time.perf_counter() - t0
                    n += len(ev["token_ids"])
                    if ev["finished"]:
                        finish = ev
            if finish is None or finish.get("finish_reason") == "error":
                return -1, f"stream ended without a clean finish: {finish}", t0
            rec.ttfts.append(first if first is not None else time.perf_counter() - t0)
        else:
            r = await client.post("/v1/generate", json=body, timeout=timeout)
            if r.status_code != 200:
                return r.status_code, r.text, t0
            data = r.json()
            if data.get("finish_reason") == "error":
                return -1, f"finish_reason=error: {data.get('error')}", t0
            n = len(data["token_ids"])
        rec.latencies.append(time.perf_counter() - t0)
        rec.tokens += n
        rec.completed += 1
        return 200, "", t0
    except httpx.TimeoutException as e:
        return -2, f"timeout: {e!r}", t0
    except httpx.HTTPError as e:
        return -3, f"{type(e).__name__}: {e}", t0


async def client_loop(cid: int, client, args, vocab, prefixes, deadline, rec: Recorder):
    rng = random.Random(args.seed * 1000 + cid)
    while time.monotonic() < deadline:
        stream = rng.random() < args.stream_fraction
        status, detail, t0 = await one_request(client, make_body(rng, args, vocab, prefixes), stream,
                                               rec, args.request_timeout)
        if status in (429, 503):  # a refusal with Retry-After, not an error: back off
            rec.rejected += 1
            await asyncio.sleep(min(1.0, max(0.05, deadline - time.monotonic())))
        elif status != 200:
            rec.error({-1: "bad_finish", -2: "timeout", -3: "transport"}.get(status, f"http_{status}"), detail)


async def wait_drained(client: httpx.AsyncClient, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    stats = (await client.get("/stats")).json()
    while stats.get("in_flight", 0) > 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        stats = (await client.get("/stats")).json()
    return stats


async def run(args) -> dict:
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=args.url, limits=limits, timeout=args.request_timeout) as client:
        health = await client.get("/health")
        if health.status_code != 200:
            raise SystemExit(f"{args.url}/health answered {health.status_code}: {health.text}")
        before = (await client.get("/stats")).json()
        vocab = args.vocab or before["vocab_size"]
        rng = random.Random(args.seed)
        prefixes = [[rng.randrange(vocab) for _ in range(args.shared_prefix)] for _ in range(args.num_prefixes)]
        rec = Recorder()
        t0 = time.monotonic()
        deadline = t0 + args.duration
        tasks = [asyncio.create_task(client_loop(i, client, args, vocab, prefixes, deadline, rec))
                 for i in range(args.clients)]
        # Bounded: clients stop starting requests at the deadline; each request has its own timeout.
        await asyncio.wait_for(asyncio.gather(*tasks), args.duration + args.request_timeout + 5)
        wall = time.monotonic() - t0
        after = await wait_drained(client, args.drain_timeout)
    lat = rec.latencies
    steps = after["steps"] - before["steps"]
    gen = after["tokens_generated"] - before["tokens_generated"]
    report = {
        "url": args.url,
        "clients": args.clients,
        "duration_s": args.duration,
        "wall_s": round(wall, 2),
        "requests_completed": rec.completed,
        "errors": sum(rec.errors.values()),
        "errors_by_kind": dict(rec.errors),
        "error_samples": rec.samples,
        "rejected_503": rec.rejected,
        "latency_p50_s": _r(percentile(lat, 0.50)),
        "latency_p99_s": _r(percentile(lat, 0.99)),
        "latency_mean_s": _r(sum(lat) / len(lat) if lat else None),
        "ttft_p50_s": _r(percentile(rec.ttfts, 0.50)),
        "ttft_p99_s": _r(percentile(rec.ttfts, 0.99)),
        "requests_per_s": round(rec.completed / wall, 2),
        "tokens_received": rec.tokens,
        "tokens_per_s": round(rec.tokens / wall, 1),
        "server_tokens_generated": gen,
        "server_steps": steps,
        "mean_batch_size": round(gen / steps, 2) if steps else None,
        "server_max_batch_size": after["max_batch_size"],
        "in_flight_at_end": after["in_flight"],
        "kv_blocks_used_at_end": after["kv_blocks_used"],
        "kv_blocks_total": after["kv_blocks_total"],
        "prefix_cache_hit_rate": round(after["prefix_cache_hit_rate"], 4),
        "cascade_rate": round(after["cascade_rate"], 4),
        "preemptions": after["preemptions"] - before["preemptions"],
        "settings": {k: getattr(args, k) for k in ("max_tokens", "prompt_len", "shared_prefix",
                                                   "num_prefixes", "stream_fraction",
                                                   "sampled_fraction", "seed")},
    }
    report["leaked_blocks"] = report["kv_blocks_used_at_end"] if report["in_flight_at_end"] == 0 else None
    return report


def _r(x):
    return None if x is None else round(x, 4)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the Serve app (default: localhost:8000)")
    p.add_argument("--clients", type=int, default=32, help="concurrent clients")
    p.add_argument("--duration", type=float, default=30.0, help="seconds to send requests for")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens per request (drawn from [n/2, n])")
    p.add_argument("--prompt-len", type=int, default=48, help="random prompt tokens after the shared prefix (1..n)")
    p.add_argument("--shared-prefix", type=int, default=32, help="tokens of the shared prefix")
    p.add_argument("--num-prefixes", type=int, default=4, help="distinct shared prefixes")
    p.add_argument("--stream-fraction", type=float, default=0.25, help="share of requests that stream")
    p.add_argument("--sampled-fraction", type=float, default=0.5, help="share of requests with temperature>0 and a seed")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: from /stats)")
    p.add_argument("--request-timeout", type=float, default=60.0, help="seconds per request")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to wait for in_flight to reach 0")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "load_test.json"))
    p.add_argument("--check", action="store_true", help="exit 1 unless 0 errors and 0 leaked blocks")
    args = p.parse_args(argv)
    if args.clients < 1 or args.duration <= 0:
        p.error("--clients must be >= 1 and --duration > 0")
    report = asyncio.run(run(args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    keys = ["requests_completed", "errors", "rejected_503", "latency_p50_s", "latency_p99_s",
            "tokens_per_s", "mean_batch_size", "kv_blocks_used_at_end", "kv_blocks_total", "leaked_blocks"]
    for k in keys:
        print(f"{k:>22}: {report[k]}")
    if report["errors"]:
        print("error samples:\n  " + "\n  ".join(report["error_samples"]))
    print(f"wrote {out}")
    if args.check and (report["errors"] or report["leaked_blocks"] != 0):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
