#!/usr/bin/env python
"""Losing a node under load, with and without resumption, on a simulated multi-node cluster.

A head node (Serve's controller, proxy and the front) and ``--nodes`` worker nodes of
``--replicas-per-node`` replicas each (TP=1, CPU); ``--clients`` clients stream
``/v1/generate`` requests back to back (half greedy, half seeded, each body fixed by its client
and turn).  At ``--loss-at`` seconds the node holding the most streams is removed (its raylet
killed with every process on it); the load runs on to ``--duration``.  Then every request that
was sent is asked again on the surviving cluster, without a fault, and each answer compared
token by token.  Two runs, each on a fresh cluster: resumption on (``max_request_attempts``
3) and off (1: the front ends a lost stream with an error event).

Reported per run: requests sent, completed as the fault-free run, lost (an error, a cut or a
different answer), tokens duplicated or missing in the streams, the time from the loss to the
first token of each resumed stream, and tokens/s before and after the loss::

    python scripts/bench_node_loss.py                     # 3 nodes x 2 replicas, 32 clients
    python scripts/bench_node_loss.py --nodes 2 --replicas-per-node 1 --clients 8 --duration 12 --loss-at 5

Writes benchmarks/results/bench_node_loss.json and a plot of tokens/s over time (.png).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import httpx

import simcluster
from benchlib import RESULTS, machine, stretched

MAX_TOKENS = 48


def body(client: int, turn: int) -> dict:
    b = {"prompt_token_ids": [(7 * client + 3 * turn + k) % 500 + 3 for k in range(24)], "max_tokens": MAX_TOKENS,
         "ignore_eos": True, "stream": True}
    if client % 2:
        b.update(temperature=1.0, seed=1000 * client + turn)
    return b


class Record:
    """One streamed request: its body, the replica that began it, each event's arrival time."""

    def __init__(self, client: int, turn: int, t0: float):
        self.client, self.turn, self.t0 = client, turn, t0
        self.replica = None
        self.events: list[tuple[float, dict]] = []
        self.error = None
        self.done = False

    @property
    def tokens(self) -> list[int]:
        return [t for _, e in self.events for t in e.get("token_ids", [])]

    def index_faults(self) -> tuple[int, int]:
        """(tokens repeated, tokens skipped) by the events' ``index`` field."""
        seen, dup, gap = 0, 0, 0
        for _, e in self.events:
            if e["index"] < seen:
                dup += seen - e["index"]
            elif e["index"] > seen:
                gap += e["index"] - seen
            seen = e["index"] + len(e["token_ids"])
        return dup, gap


def client_loop(url: str, client: int, stop_at: float, start: float, records: list, lock):
    turn = 0
    with httpx.Client(timeout=stretched(120)) as c:
        while time.monotonic() < stop_at:
            rec = Record(client, turn, time.monotonic() - start)
            with lock:
                records.append(rec)
            try:
                with c.stream("POST", url + "/v1/generate", json=body(client, turn)) as r:
                    rec.replica = r.headers.get("x-replica-id")
                    if r.status_code != 200:
                        rec.error = f"HTTP {r.status_code}"
                    else:
                        for line in r.iter_lines():
                            if line == "data: [DONE]":
                                rec.done = True
                            elif line.startswith("data: "):
                                e = json.loads(line[6:])
                                if "token_ids" in e:
                                    rec.events.append((time.monotonic() - start, e))
                                else:
                                    rec.error = e.get("detail", "error event")
            except httpx.HTTPError as e:
                rec.error = f"{type(e).__name__}: {e}"
            turn += 1


def run(args, resume: bool) -> dict:
    from ray import serve

    from ray_attn.serve.app import build_app
    from ray_attn.serve.app_config import default_engine_config

    sim = simcluster.start_cluster(args.nodes, replica_cpus=1.0, replicas_per_node=args.replicas_per_node)
    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": args.port})
        eng = default_engine_config().model_dump(mode="json")
        eng["parallel"].update(tensor_parallel_size=1)
        eng.update(max_num_seqs=16)
        n = args.nodes * args.replicas_per_node
        app = dict(engine=eng, executor="in_process", replica_num_cpus=1.0, num_replicas=n,
                   replica_resource=simcluster.REPLICA_RESOURCE, resume_requests=True,
                   max_request_attempts=3 if resume else 1, retry_timeout_s=stretched(30),
                   prefix_router={"ingress_resources": {simcluster.FRONT_RESOURCE: 0.01}},
                   max_connections=256, max_requests_per_client=256, health_check_period_s=2.0,
                   health_check_timeout_s=stretched(30), health_ping_timeout_s=stretched(15))
        serve.run(build_app(app), name="bench", route_prefix="/bench", blocking=False)
        nodes = simcluster.wait_replicas("bench", n, timeout=300)
        url = f"http://127.0.0.1:{args.port}/bench"
        print(f"[{'resume' if resume else 'no resume'}] {n} replicas on {len(set(nodes.values()))} nodes; "
              f"{args.clients} clients for {args.duration:g}s, a node lost at {args.loss_at:g}s", flush=True)

        records, lock = [], threading.Lock()
        start = time.monotonic()
        threads = [threading.Thread(target=client_loop, args=(url, i, start + args.duration, start, records, lock),
                                    daemon=True) for i in range(args.clients)]
        for t in threads:
            t.start()
        time.sleep(max(0.0, start + args.loss_at - time.monotonic()))
        with lock:
            live = [r for r in records if not r.done and r.error is None and r.replica]
        on_node: dict[str, int] = {}
        for r in live:
            node = nodes.get(r.replica)
            if node is not None:
                on_node[node] = on_node.get(node, 0) + 1
        victim = max(on_node, key=on_node.get) if on_node else next(iter(nodes.values()))
        lost_replicas = {rid for rid, node in nodes.items() if node == victim}
        t_loss = time.monotonic() - start
        sim.remove(sim.node_of(victim))
        for t in threads:
            t.join(stretched(300))
        print(f"  node lost at {t_loss:.1f}s under {on_node.get(victim, 0)} streams; "
              f"{len(records)} requests sent; checking against fault-free answers", flush=True)

        # the fault-free answers, on the surviving replicas
        want: dict[tuple[int, int], list[int]] = {}
        with httpx.Client(timeout=stretched(120)) as c:
            for r in records:
                b = dict(body(r.client, r.turn), stream=False)
                want[(r.client, r.turn)] = c.post(url + "/v1/generate", json=b).json()["token_ids"]
        return summarize(records, want, t_loss, lost_replicas, args, resume, on_node.get(victim, 0))
    finally:
        simcluster.stop_cluster(sim)


def summarize(records, want, t_loss, lost_replicas, args, resume, streams_on_lost) -> dict:
    ok = lost = dup = gap = 0
    resumed_gaps = []
    for r in records:
        d, g = r.index_faults()
        dup, gap = dup + d, gap + g
        if r.done and r.error is None and r.tokens == want[(r.client, r.turn)]:
            ok += 1
        else:
            lost += 1
        if r.replica in lost_replicas and r.error is None:
            # a resumed stream: events before the loss, the silence while the front sends it to
            # another replica, then the rest; the first token after the longest silence that
            # ends after the loss is the first resumed one
            times = [t for t, _ in r.events]
            gaps = [(b - a, b) for a, b in zip(times, times[1:]) if a < t_loss <= b or a >= t_loss]
            if times and times[0] < t_loss and gaps:
                resumed_gaps.append(max(gaps)[1] - t_loss)
    # tokens/s in 1 s bins, and the means before the loss and after the recovery
    bins = [0] * (int(args.duration) + 30)
    for r in records:
        for t, e in r.events:
            if int(t) < len(bins):
                bins[int(t)] += len(e["token_ids"])
    end = int(max((t for r in records for t, _ in r.events), default=args.duration))
    pre = bins[1:int(t_loss)]
    post_from = int(t_loss + (max(resumed_gaps) if resumed_gaps else 0)) + 1
    post = bins[post_from:min(end, int(args.duration))]
    return {
        "resume": resume, "nodes": args.nodes, "replicas_per_node": args.replicas_per_node,
        "clients": args.clients, "max_tokens": MAX_TOKENS, "loss_at_s": round(t_loss, 2),
        "streams_on_lost_node": streams_on_lost, "requests": len(records), "completed_as_fault_free": ok,
        "requests_lost": lost, "tokens_duplicated": dup, "tokens_missing": gap,
        "streams_continued_past_the_loss": len(resumed_gaps),
        "loss_to_first_resumed_token_s": {"median": round(sorted(resumed_gaps)[len(resumed_gaps) // 2], 2),
                                          "max": round(max(resumed_gaps), 2)} if resumed_gaps else None,
        "tokens_per_s_before": round(sum(pre) / max(1, len(pre)), 1),
        "tokens_per_s_after": round(sum(post) / max(1, len(post)), 1),
        "tokens_per_s_series": bins[:end + 1],
    }


def plot(rows: list[dict], path: Path) -> None:
    from plotting import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    for r in rows:
        label = ("resumption on" if r["resume"] else "resumption off") + f": {r['requests_lost']} lost"
        ax.plot(range(len(r["tokens_per_s_series"])), r["tokens_per_s_series"], label=label)
        ax.axvline(r["loss_at_s"], color="grey", linestyle=":")
    ax.set_xlabel("seconds")
    ax.set_ylabel("tokens/s streamed")
    ax.set_title(f"A node lost under load ({rows[0]['nodes']} nodes x {rows[0]['replicas_per_node']} replicas, "
                 f"{rows[0]['clients']} clients)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--replicas-per-node", type=int, default=2)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of load")
    ap.add_argument("--loss-at", type=float, default=10.0, help="seconds into the load")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--only", choices=["resume", "no-resume"], help="one of the two runs")
    ap.add_argument("--output", default=str(RESULTS / "bench_node_loss.json"))
    a = ap.parse_args(argv)
    if a.nodes < 2:
        ap.error("--nodes: at least 2 (one is lost)")
    if not 0 < a.loss_at < a.duration:
        ap.error("--loss-at: must fall within --duration")
    modes = [m == "resume" for m in ([a.only] if a.only else ["resume", "no-resume"])]
    rows = [run(a, resume) for resume in modes]
    for r in rows:
        print(json.dumps({k: v for k, v in r.items() if k != "tokens_per_s_series"}))
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1) + "\n")
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
