#!/usr/bin/env python
"""Losing a node -- or a front replica -- under streaming load, on a simulated multi-node cluster.

A head node (Serve's controller, proxy and one front replica) and ``--nodes`` worker nodes of
``--replicas-per-node`` LLMServer replicas (TP=1, CPU) and one front replica each
(``ingress_max_replicas_per_node: 1``).  ``--clients`` clients stream ``/v1/generate``
requests back to back (half greedy, half seeded, each body fixed by its client and turn); a
client whose connection is cut reconnects with its ``X-Request-Id`` and ``Last-Event-ID``
(``ray_attn.serve.sse_client``).  At ``--loss-at`` seconds one loss, a row each (``--losses``):

- ``worker-node``: the worker node holding the most streams is removed (its raylet killed with
  every process on it: its replicas, their streams, its front replica);
- ``head-front``: the head's front replica is SIGKILLed (the head itself stays: it holds the GCS);
- ``worker-node-no-resume``: as ``worker-node`` with ``max_request_attempts: 1`` and clients
  that do not reconnect -- what is lost without resumption;
- ``head-node``: the head node itself (its raylet, the GCS, Serve's controller, its proxy and
  front replica), on a cluster of ``ray start`` nodes whose GCS keeps its tables in RocksDB; a
  head is started again ``--outage`` seconds later at the same address (``run_head_node``).

The load runs on to ``--duration``; then every request sent is asked again on the surviving
cluster, without a fault, and each answer compared token by token.  Reported per row: requests
sent, completed as the fault-free run, lost (an error, a cut or a different answer), resumed
(a stream that crossed a replica or a front: a reconnection, or a replica lost under it),
tokens duplicated or missing (the events' ids and ``index``), and the time from the loss to
the first token of each stream it interrupted::

    python scripts/bench_node_loss.py                     # 3 worker nodes x 2 replicas, 32 clients
    python scripts/bench_node_loss.py --nodes 2 --replicas-per-node 1 --clients 4 --duration 8 --loss-at 3

Writes benchmarks/results/bench_node_loss.json and a plot of tokens/s over time (.png).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

import simcluster
from benchlib import RESULTS, machine, stretched
from ray_attn.serve.sse_client import faults, stream

MAX_TOKENS = 48
LOSSES = ("worker-node", "head-front", "worker-node-no-resume", "head-node")


def body(client: int, turn: int) -> dict:
    b = {"prompt_token_ids": [(7 * client + 3 * turn + k) % 500 + 3 for k in range(24)], "max_tokens": MAX_TOKENS,
         "ignore_eos": True, "stream": True}
    if client % 2:
        b.update(temperature=1.0, seed=1000 * client + turn)
    return b


class Record:
    """One streamed request: the client's stream, and each event's arrival time."""

    def __init__(self, client: int, turn: int):
        self.client, self.turn = client, turn
        self.times: list[float] = []
        self.s = None

    @property
    def tokens(self) -> list[int]:
        return [t for e in self.s.events if isinstance(e, dict) for t in e.get("token_ids", [])]

    def index_faults(self) -> tuple[int, int]:
        """(tokens repeated, tokens skipped) by the events' ``index`` field."""
        seen, dup, gap = 0, 0, 0
        for e in self.s.events:
            if not isinstance(e, dict) or "index" not in e:
                continue
            if e["index"] < seen:
                dup += seen - e["index"]
            elif e["index"] > seen:
                gap += e["index"] - seen
            seen = e["index"] + len(e["token_ids"])
        return dup, gap


def client_loop(url, client, stop_at, start, records, lock, reconnect: bool):
    turn = 0
    while time.monotonic() < stop_at:
        rec = Record(client, turn)
        with lock:
            records.append(rec)
        rec.s = stream(url + "/v1/generate", body(client, turn), reconnect=reconnect, timeout=stretched(120),
                       on_event=lambda s, rec=rec: rec.times.append(time.monotonic() - start),
                       on_open=lambda s, rec=rec: setattr(rec, "s", s))
        turn += 1


def start_clients(url: str, args, reconnect: bool):
    """``--clients`` streaming clients until ``--duration``; returns at ``--loss-at`` with
    (records, their lock, the start time, the threads)."""
    records, lock = [], threading.Lock()
    start = time.monotonic()
    threads = [threading.Thread(target=client_loop, daemon=True,
                                args=(url, i, start + args.duration, start, records, lock, reconnect))
               for i in range(args.clients)]
    for t in threads:
        t.start()
    time.sleep(max(0.0, start + args.loss_at - time.monotonic()))
    return records, lock, start, threads


def fault_free(url: str, records: list, args) -> dict[tuple[int, int], list[int]]:
    """Every request sent, asked again without a fault (``--check-clients`` at a time)."""
    want: dict[tuple[int, int], list[int]] = {}

    def ask(c: httpx.Client, r: Record) -> None:
        b = dict(body(r.client, r.turn), stream=False)
        want[(r.client, r.turn)] = c.post(url + "/v1/generate", json=b).json()["token_ids"]

    with httpx.Client(timeout=stretched(120)) as c, ThreadPoolExecutor(args.check_clients) as pool:
        list(pool.map(lambda r: ask(c, r), records))
    return want


def app_args(args, resume: bool = True) -> dict:
    """The app under test: ``nodes x replicas-per-node`` replicas, a front replica per node."""
    from ray_attn.serve.app_config import default_engine_config

    eng = default_engine_config().model_dump(mode="json")
    eng["parallel"].update(tensor_parallel_size=1)
    eng.update(max_num_seqs=16)
    return dict(engine=eng, executor="in_process", replica_num_cpus=1.0, num_replicas=args.nodes * args.replicas_per_node,
                replica_resource=simcluster.REPLICA_RESOURCE, resume_requests=True,
                max_request_attempts=3 if resume else 1, retry_timeout_s=stretched(30),
                prefix_router={"ingress_num_replicas": args.nodes + 1, "ingress_max_replicas_per_node": 1},
                max_connections=256, max_requests_per_client=256, health_check_period_s=2.0,
                health_check_timeout_s=stretched(30), health_ping_timeout_s=stretched(15))


def run(args, loss: str) -> dict:
    if loss == "head-node":
        return run_head_node(args)
    from ray import serve

    from ray_attn.serve.app import build_app

    resume = not loss.endswith("no-resume")
    sim = simcluster.start_cluster(args.nodes, replica_cpus=1.0, replicas_per_node=args.replicas_per_node,
                                   front_cpus=1.0)
    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": args.port})
        n = args.nodes * args.replicas_per_node
        app = app_args(args, resume)
        serve.run(build_app(app), name="bench", route_prefix="/bench", blocking=False)
        nodes = simcluster.wait_replicas("bench", n, timeout=300)
        fronts = simcluster.replica_actors("bench", "PrefixRoutingIngress")
        url = f"http://127.0.0.1:{args.port}/bench"
        print(f"[{loss}] {n} replicas on {len(set(nodes.values()))} nodes, {len(fronts)} fronts; "
              f"{args.clients} clients for {args.duration:g}s, the loss at {args.loss_at:g}s", flush=True)

        records, lock, start, threads = start_clients(url, args, resume)
        head = sim.cluster.head_node.node_id
        # --loss-wait-for-hit: a loss that would hit no stream waits (up to that long) for one
        wait_until = time.monotonic() + args.loss_wait_for_hit
        while True:
            # a stream counts as under the loss only while most of its tokens are still to come: one
            # about to end may finish between this count and the kill, with nothing left to resume
            with lock:
                live = [r for r in records if r.s is not None and not r.s.done and r.s.connections
                        and len(r.tokens) < MAX_TOKENS // 2]
            if loss.startswith("worker-node"):
                on_node: dict[str, int] = {}
                for r in live:
                    node = nodes.get(r.s.connections[0].replica)
                    if node is not None:
                        on_node[node] = on_node.get(node, 0) + 1
                victim = max(on_node, key=on_node.get) if on_node else next(iter(nodes.values()))
                under = [r for r in live if nodes.get(r.s.connections[0].replica) == victim]
            else:  # the head's front replica
                uid, actor = next((u, a) for u, a in fronts.items() if a["Address"]["NodeID"] == head)
                under = [r for r in live if r.s.connections[0].front == uid]
            hit = len(under)
            if hit or time.monotonic() >= min(wait_until, start + args.duration):
                break
            time.sleep(0.02)
        t_loss = time.monotonic() - start
        if loss.startswith("worker-node"):
            killed = sim.remove(sim.node_of(victim))
            gone_at = time.monotonic()  # its processes are dead by now
            print(f"  lost node {victim[:8]} ({len(killed)} processes killed), its replicas "
                  f"{sorted(u for u, n in nodes.items() if n == victim)}", flush=True)
        else:
            os.kill(actor["Pid"], signal.SIGKILL)
            gone_at = time.monotonic()
        for t in threads:
            t.join(stretched(300))
        print(f"  loss at {t_loss:.1f}s under {hit} streams; {len(records)} requests sent; "
              f"checking against fault-free answers", flush=True)

        want = fault_free(url, records, args)
        from ray_attn.serve import progress_store

        logs = {r.s.request_id: progress_store.find("bench", r.s.request_id) for r in records}
        return summarize(records, want, t_loss, args, loss, under, logs, gone_at - start)
    finally:
        simcluster.stop_cluster(sim)


DEPLOY = """
import json, ray
from ray import serve
import simcluster
from ray_attn.serve.app import build_app
ray.init(address=ADDRESS, log_to_driver=False)
serve.start(proxy_location="EveryNode", http_options={{"host": "127.0.0.1", "port": {port}}})
serve.run(build_app(json.loads({app!r})), name="bench", route_prefix="/bench", blocking=False)
nodes = simcluster.wait_replicas("bench", {n}, timeout=300)
fronts = simcluster.replica_nodes("bench", "PrefixRoutingIngress")
head = [x["NodeID"] for x in ray.nodes() if x["Alive"] and "node:__internal_head__" in x["Resources"]]
print("DEPLOYED " + json.dumps(dict(nodes=nodes, fronts=fronts, head=head[0])))
"""


def run_head_node(args) -> dict:
    """The head node lost -- its raylet, the GCS, Serve's controller, its proxy and front, every
    process on it -- under load, and a head started again ``--outage`` seconds later at the same
    address over the GCS's RocksDB tables (``raystart_cluster.py``).  Serve runs a proxy on every
    node (``EveryNode``; on one machine they share the port through SO_REUSEPORT), so clients cut
    by the head's proxy or front reconnect through a worker node's."""
    import raystart_cluster

    n = args.nodes * args.replicas_per_node
    c = raystart_cluster.start(args.nodes, worker_cpus=args.replicas_per_node + 1,
                               worker_resources={simcluster.REPLICA_RESOURCE: args.replicas_per_node},
                               head_cpus=simcluster.HEAD_CPUS)
    try:
        out = c.run_driver(DEPLOY.format(port=args.port, app=json.dumps(app_args(args)), n=n), timeout=stretched(400))
        placed = json.loads(out.split("DEPLOYED ", 1)[1])
        head_fronts = {u for u, node in placed["fronts"].items() if node == placed["head"]}
        url = f"http://127.0.0.1:{args.port}/bench"
        print(f"[head-node] {n} replicas on {len(set(placed['nodes'].values()))} nodes, {len(placed['fronts'])} fronts "
              f"({len(head_fronts)} on the head); {args.clients} clients for {args.duration:g}s, the loss at "
              f"{args.loss_at:g}s, a new head {args.outage:g}s later", flush=True)
        records, lock, start, threads = start_clients(url, args, True)
        wait_until = time.monotonic() + args.loss_wait_for_hit
        while True:
            with lock:  # live on the head's front, with most of their tokens to come
                under = [r for r in records if r.s is not None and not r.s.done and r.s.connections
                         and r.s.connections[0].front in head_fronts and len(r.tokens) < MAX_TOKENS // 2]
            if under or time.monotonic() >= min(wait_until, start + args.duration):
                break
            time.sleep(0.02)
        t_loss = time.monotonic() - start
        killed = c.kill_head()
        gone_at = time.monotonic()
        print(f"  lost the head ({len(killed)} processes killed) under {len(under)} streams of its front", flush=True)
        time.sleep(args.outage)
        c.start_head()
        for t in threads:
            t.join(stretched(300))
        print(f"  {len(records)} requests sent; checking against fault-free answers", flush=True)
        want = fault_free(url, records, args)
        row = summarize(records, want, t_loss, args, "head-node", under, {}, gone_at - start)
        row["outage_s"] = args.outage
        return row
    finally:
        c.stop()


def crossed(r: Record, log) -> bool:
    """Whether the stream went on past a loss: a reconnection, a retried answer, or a replica lost
    under it that its front replaced (the stream's resume comment, or the front's log)."""
    return r.s.reconnects > 0 or any(c.attempt not in (None, "1") for c in r.s.connections) \
        or len(r.s.replicas) > 1 or (log is not None and len(log.replicas) > 1)


def ended_first(r: Record, log) -> bool:
    """Done, on the one replica its front's log names, though that replica was lost under it: its
    tokens were all made before the replica died (a dead replica makes none) and reached the
    client after -- the front and the client, among 32 streams on two cores, relay them seconds
    behind the engine.  Not a stream the loss cut."""
    return not crossed(r, log) and r.s.done and r.s.error is None and (log is None or len(log.replicas) <= 1)


def summarize(records, want, t_loss, args, loss, under, logs, t_gone=None) -> dict:
    """The row; ``under`` are the streams live on the lost node or front when its loss began,
    ``t_gone`` when its processes were dead (``loss_took_s``)."""
    ok = lost = dup = gap = resumed = 0
    examples = []
    gaps_after_loss = []
    for r in records:
        d, g = r.index_faults()
        d2, g2 = faults(r.s)
        dup, gap = dup + d + d2, gap + g + g2
        if r.s.done and r.s.error is None and r.tokens == want[(r.client, r.turn)]:
            ok += 1
        else:
            lost += 1
            examples.append({"request_id": r.s.request_id, "done": r.s.done, "error": (r.s.error or "")[:300],
                             "connections": [c.__dict__ for c in r.s.connections],
                             "tokens": len(r.tokens), "want": len(want[(r.client, r.turn)])})
        interrupted = r.times and r.times[0] < t_loss and (r.times[-1] > t_loss)
        if interrupted:
            after = [b for a, b in zip(r.times, r.times[1:]) if b > t_loss]
            if after:
                gaps_after_loss.append(max(b - a for a, b in zip(r.times, r.times[1:]) if b > t_loss))
        resumed += crossed(r, logs.get(r.s.request_id))
    bins = [0] * (int(args.duration) + 30)
    for r in records:
        for t in r.times:
            if int(t) < len(bins):
                bins[int(t)] += 1
    end = int(max((t for r in records for t in r.times), default=args.duration))
    gaps_after_loss.sort()
    return {
        "loss": loss, "nodes": args.nodes, "replicas_per_node": args.replicas_per_node, "clients": args.clients,
        "max_tokens": MAX_TOKENS, "loss_at_s": round(t_loss, 2), "streams_hit": len(under),
        # of those, the ones the loss cut (not done when it came): each must have been resumed
        "streams_hit_resumed": sum(crossed(r, logs.get(r.s.request_id)) for r in under),
        # the others: made all their tokens before the loss, delivered after it (ended_first)
        "streams_hit_ended_first": sum(ended_first(r, logs.get(r.s.request_id)) for r in under),
        "loss_took_s": round(t_gone - t_loss, 2) if t_gone is not None else None,
        "requests": len(records),
        "completed_as_fault_free": ok, "requests_lost": lost, "requests_resumed": resumed,
        "tokens_duplicated": dup, "tokens_missing": gap,
        "longest_silence_after_loss_s": {"median": round(gaps_after_loss[len(gaps_after_loss) // 2], 2),
                                         "max": round(gaps_after_loss[-1], 2)} if gaps_after_loss else None,
        "lost_examples": examples[:3],
        # streams under the loss that show no crossing and did not end first: what they saw (none, or a bug)
        "hit_uncrossed_examples": [{"request_id": r.s.request_id, "tokens": len(r.tokens), "done": r.s.done,
                                    "first_event_s": round(r.times[0], 2) if r.times else None,
                                    "last_event_s": round(r.times[-1], 2) if r.times else None,
                                    "connections": [c.__dict__ for c in r.s.connections],
                                    "log_replicas": list(getattr(logs.get(r.s.request_id), "replicas", None) or [])}
                                   for r in under if not crossed(r, logs.get(r.s.request_id))
                                   and not ended_first(r, logs.get(r.s.request_id))][:4],
        "events_per_s_series": bins[:end + 1],
    }


def plot(rows: list[dict], path: Path) -> None:
    from plotting import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    for r in rows:
        ax.plot(range(len(r["events_per_s_series"])), r["events_per_s_series"],
                label=f"{r['loss']}: {r['requests_lost']} lost")
        ax.axvline(r["loss_at_s"], color="grey", linestyle=":")
    ax.set_xlabel("seconds")
    ax.set_ylabel("events/s streamed")
    ax.set_title(f"Losses under load ({rows[0]['nodes']} nodes x {rows[0]['replicas_per_node']} replicas, "
                 f"{rows[0]['clients']} clients)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=3, help="worker nodes (the head besides)")
    ap.add_argument("--replicas-per-node", type=int, default=2)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of load")
    ap.add_argument("--loss-at", type=float, default=10.0, help="seconds into the load")
    ap.add_argument("--loss-wait-for-hit", type=float, default=0.0,
                    help="seconds the loss may wait past --loss-at (within --duration) for a stream on its "
                         "victim to hit (default 0: the loss falls at --loss-at, hit or not)")
    ap.add_argument("--check-clients", type=int, default=1,
                    help="requests in flight while asking the fault-free answers (default 1: one at a time)")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--outage", type=float, default=2.0, help="head-node: seconds before a new head starts")
    ap.add_argument("--losses", default=",".join(LOSSES), help=f"comma-separated, of {', '.join(LOSSES)}")
    ap.add_argument("--output", default=str(RESULTS / "bench_node_loss.json"))
    ap.add_argument("--no-plot", action="store_true")
    a = ap.parse_args(argv)
    losses = [x for x in a.losses.split(",") if x]
    bad = [x for x in losses if x not in LOSSES]
    if bad or not losses:
        ap.error(f"--losses: {bad or 'none'}: each must be one of {', '.join(LOSSES)}")
    if a.nodes < (2 if any(x.startswith("worker-node") for x in losses) else 1):
        ap.error("--nodes: at least 2 (one is lost); 1 with only --losses head-front or head-node")
    if a.loss_wait_for_hit < 0 or a.check_clients < 1:
        ap.error("--loss-wait-for-hit must be >= 0 and --check-clients >= 1")
    if not 0 < a.loss_at < a.duration:
        ap.error("--loss-at: must fall within --duration")
    rows = [run(a, loss) for loss in losses]
    for r in rows:
        print(json.dumps({k: v for k, v in r.items() if k != "events_per_s_series"}))
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1) + "\n")
    if not a.no_plot:
        plot(rows, out.with_suffix(".png"))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
