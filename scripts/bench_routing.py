#!/usr/bin/env python
"""Prefix-aware routing against Serve's default router, on one local cluster, in one run.

Both routers serve the same request list on the same 2-replica app (``--config``, by default
``deploy/serve_config.replicas.yaml``), measured one after the other, each on fresh replicas (cold
caches); the routers' apps deploy together, each on its own route (``startup_s`` is that joint start):

* workload: ``--prefixes`` random prompt prefixes of ``--prefix-blocks`` full KV blocks, each
  request one of them plus a random tail, ``--requests`` requests from ``--clients`` concurrent
  clients, in one shuffled order used for both routers;
* prefix-cache hit rate: prompt tokens found in the cache / tokens looked up, summed over the
  replicas, read from each replica's Ray metrics (``ray_attn_prefix_cache_hits`` and
  ``..._queries``, tagged by replica) -- Serve's default router gives no way to reach one replica's
  ``/stats``;
* throughput: completed requests and generated tokens per second of wall time, client side.

``--num-blocks`` shrinks each replica's KV cache so that all prefixes do not fit in one replica
(the case a router matters for: with a cache big enough for everything, every router ends up with
every prefix cached everywhere).  Writes ``benchmarks/results/routing_cpu.json``::

    python scripts/bench_routing.py --repeats 2
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import random
import re
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.stretch import stretched  # noqa: E402
from scripts.load_test import percentile  # noqa: E402
from ray_attn.ports import loopback_port as free_port  # noqa: E402

METRIC = re.compile(r'^\w*ray_attn_prefix_cache_(hits|queries)\w*\{([^}]*)\}\s+(\S+)$', re.M)


def workload(args, vocab: int, block_size: int) -> list[dict]:
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(vocab) for _ in range(args.prefix_blocks * block_size)]
                for _ in range(args.prefixes)]
    bodies = []
    for i in range(args.requests):
        tail = [rng.randrange(vocab) for _ in range(rng.randint(1, args.tail_tokens))]
        bodies.append({"prompt_token_ids": prefixes[i % args.prefixes] + tail, "max_tokens": args.max_tokens})
    rng.shuffle(bodies)
    return bodies


def scrape(port: int) -> dict[str, list[float]]:
    """{replica: [hits, queries]} from the node's Prometheus endpoint."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=stretched(10)).text
    out: dict[str, list[float]] = {}
    for kind, labels, value in METRIC.findall(text):
        tag = re.search(r'replica="([^"]*)"', labels)
        if tag:
            out.setdefault(tag.group(1), [0.0, 0.0])[kind == "queries"] = float(value)
    return out


def settled(port: int, replicas: set[str], timeout: float = 60.0) -> dict[str, list[float]]:
    """The counters once every replica reports and two scrapes 2 s apart agree."""
    deadline, last = time.monotonic() + stretched(timeout), None
    while True:
        now = {r: v for r, v in scrape(port).items() if r in replicas}
        if now == last and set(now) == replicas:
            return now
        if time.monotonic() > deadline:
            raise TimeoutError(f"metrics did not settle: {now} (replicas {sorted(replicas)})")
        last = now
        time.sleep(2.0)


async def drive(url: str, bodies: list[dict], clients: int, timeout: float):
    queue: asyncio.Queue = asyncio.Queue()
    for b in bodies:
        queue.put_nowait(b)
    lat, placed, errors, tokens = [], Counter(), Counter(), 0

    async def client(c: httpx.AsyncClient):
        nonlocal tokens
        while not queue.empty():
            body = queue.get_nowait()
            t0 = time.perf_counter()
            try:
                r = await c.post("/v1/generate", json=body, timeout=timeout)
            except httpx.HTTPError as e:
                errors[type(e).__name__] += 1
                continue
            if r.status_code != 200:
                errors[str(r.status_code)] += 1
                continue
            out = r.json()
            lat.append(time.perf_counter() - t0)
            tokens += len(out["token_ids"])
            placed[r.headers["x-replica-id"]] += 1  # the replica that ran it

    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=clients)) as c:
        await asyncio.gather(*[client(c) for _ in range(clients)])
    return time.perf_counter() - t0, lat, placed, errors, tokens


def wait_healthy(url: str, timeout: float = 120.0) -> None:
    timeout = stretched(timeout)
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=stretched(5)).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not healthy after {timeout:.0f}s")
        time.sleep(0.5)


def deploy(routers: list[str], app_args: dict, port: int) -> tuple[dict, float]:
    """Every router's app at once (``serve.run_many``: their replicas start together), each on
    its own route; measured in turn after (``run_router``), an idle app's replicas cost nothing.
    Returns each router's URL and the seconds until all answered ``/health``."""
    from ray import serve
    from ray.serve.api import RunTarget

    from ray_attn.serve.app import build_app

    t0 = time.perf_counter()
    targets, urls = [], {}
    for router in routers:
        cfg = copy.deepcopy(app_args)
        cfg["request_router"] = router
        targets.append(RunTarget(build_app(cfg), name=f"bench_{router}", route_prefix=f"/bench_{router}"))
        urls[router] = f"http://127.0.0.1:{port}/bench_{router}"
    serve.run_many(targets, wait_for_applications_running=False)
    for url in urls.values():
        wait_healthy(url)
    return urls, time.perf_counter() - t0


def run_router(router: str, url: str, bodies: list[dict], args, startup: float) -> dict:
    """The workload through one router's app; the cache figures are added by ``add_hits`` once
    the replicas' metrics settle (one wait for every router's replicas, not one each)."""
    # Warm both replicas' first-call paths with prompts shorter than a block (no cache entries).
    warm = [{"prompt_token_ids": [1 + i, 2, 3], "max_tokens": 2} for i in range(8)]
    _, _, seen, warm_errors, _ = asyncio.run(drive(url, warm, 8, stretched(args.request_timeout)))
    assert not warm_errors, warm_errors
    wall, lat, placed, errors, tokens = asyncio.run(drive(url, bodies, args.clients,
                                                         stretched(args.request_timeout)))
    done = len(lat)
    return {
        "router": router, "requests": len(bodies), "completed": done, "errors": dict(errors),
        "requests_per_s": round(done / wall, 2), "tokens_per_s": round(tokens / wall, 1),
        "wall_s": round(wall, 2), "p50_latency_s": round(percentile(lat, 0.5) or 0, 3),
        "p99_latency_s": round(percentile(lat, 0.99) or 0, 3), "startup_s": round(startup, 1),
        "per_replica": {r: {"requests": placed[r]} for r in sorted(set(placed) | set(seen))},
    }


def add_hits(rows: list[dict], metrics_port: int) -> None:
    """Each row's prefix-cache hits and queries, from its replicas' settled counters (fresh
    replicas: everything counted is this workload's; the warm-up's prompts hit nothing)."""
    after = settled(metrics_port, {r for row in rows for r in row["per_replica"]})
    for row in rows:
        reps = row["per_replica"]
        hits = sum(after[r][0] for r in reps)
        queries = sum(after[r][1] for r in reps)
        for r, v in reps.items():
            v["prefix_cache_hit_rate"] = round(after[r][0] / after[r][1], 4) if after[r][1] else None
        row.update(prefix_cache_hit_rate=round(hits / queries, 4) if queries else None,
                   prefix_cache_hits=int(hits), prefix_cache_queries=int(queries))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "deploy" / "serve_config.replicas.yaml"),
                   help="serve run config whose first application is measured")
    p.add_argument("--routers", default="default,prefix_aware", help="comma-separated, run in order")
    p.add_argument("--prefixes", type=int, default=8, help="distinct shared prefixes")
    p.add_argument("--prefix-blocks", type=int, default=48, help="full KV blocks per prefix")
    p.add_argument("--tail-tokens", type=int, default=24, help="most random tokens after the prefix")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=256, help="KV blocks per replica (0: keep the config's)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the routers in turn this many times (machine noise shows as spread)")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "routing_cpu.json"))
    args = p.parse_args(argv)
    for name in ("prefixes", "prefix_blocks", "tail_tokens", "requests", "clients", "max_tokens", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    routers = args.routers.split(",")
    if not routers or any(r not in ("default", "prefix_aware") for r in routers):
        p.error(f"--routers: each of 'default', 'prefix_aware', got {args.routers!r}")

    data = yaml.safe_load(Path(args.config).read_text())
    app_args = data["applications"][0]["args"]
    if args.num_blocks:
        app_args.setdefault("engine", {}).setdefault("cache", {})["num_blocks"] = args.num_blocks
    from ray_attn.serve.schemas import ServeAppConfig

    cfg = ServeAppConfig.model_validate(app_args)
    bodies = workload(args, cfg.engine.model.vocab_size, cfg.engine.cache.block_size)

    import ray
    from ray import serve

    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p)
    # Called in-process with a Ray already up (the tests: one started with the same metrics
    # interval), that Ray is used and left up.
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
                 _system_config={"metrics_report_interval_ms": 1000})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    metrics_port = ray._private.worker.global_worker.node.metrics_export_port
    rows = []
    try:
        urls, startup = deploy(routers, app_args, port)
        for repeat in range(args.repeats):
            if repeat:  # fresh replicas again: the first repeat's cache entries would be hits
                for router in routers:
                    serve.delete(f"bench_{router}")
                urls, startup = deploy(routers, app_args, port)
            done = [dict(run_router(router, urls[router], bodies, args, startup), repeat=repeat)
                    for router in routers]
            add_hits(done, metrics_port)
            for row in done:
                print(json.dumps(row), flush=True)
            rows += done
    finally:
        serve.shutdown()
        if started:
            ray.shutdown()
    from scripts.benchlib import machine

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    workload_info = {k: getattr(args, k) for k in ("prefixes", "prefix_blocks", "tail_tokens", "requests",
                                                   "clients", "max_tokens", "num_blocks", "seed", "repeats")}
    out.write_text(json.dumps({"machine": machine(), "command": "python scripts/bench_routing.py "
                               + " ".join(argv if argv is not None else sys.argv[1:]),
                               "config": str(Path(args.config).resolve().relative_to(REPO)),
                               "replicas": cfg.num_replicas or 1, "workload": workload_info,
                               "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0 if all(r["completed"] == r["requests"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
