"""The Serve app on a simulated multi-node cluster (``conftest.py``): a head and two worker nodes,
one replica each (TP=2: its ranks beside it, in its STRICT_PACK placement group).

- Placement: the replicas are on different nodes, each with both of its ranks.
- Losing a node under load (its raylet killed with every process on it): every stream and
  every non-streaming request that was on it completes on the other replica, the client
  receiving what a fault-free run gives -- each token once, in order.
- Serve brings the lost replica back on a node that joins, without a restart of the app.
- With every node gone, a stream ends with an error event within ``retry_timeout_s`` and a new
  request is a 503: never a silent hang, nor a cut that looks finished.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.cluster.conftest import REPLICA_CPUS, FRONT_RESOURCE, REPLICA_RESOURCE, replica_nodes, wait_replicas
from tests.serve.helpers import engine_config, openai_text, sse_events, tokens_of
from tests.timescale import scaled

pytestmark = pytest.mark.slow
APP, ROUTE = "multinode", "/mn"
TP = 2
APP_ARGS: dict = {}  # the app's args, set by the fixture
assert REPLICA_CPUS >= 1 + TP * 0.5  # a node holds the replica's bundle and its ranks' (0.5 each)


@pytest.fixture(scope="module")
def app(sim_cluster):
    from ray import serve

    from ray_attn.serve.app import build_app
    from tests.serve.conftest import free_port

    sim = sim_cluster.get(workers=2)
    try:
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        eng = engine_config(tp=TP, max_num_seqs=8)
        args = dict(engine=eng.model_dump(mode="json"), executor="ray", replica_num_cpus=1.0,
                    num_replicas=2, replica_resource=REPLICA_RESOURCE, resume_requests=True,
                    max_request_attempts=4, retry_timeout_s=scaled(10.0), max_tokens_limit=256, max_connections=128,
                    max_requests_per_client=128, health_check_period_s=1.0,
                    prefix_router={"ingress_resources": {FRONT_RESOURCE: 0.01}},
                    health_check_timeout_s=scaled(10.0), health_ping_timeout_s=scaled(5.0))
        serve.run(build_app(args), name=APP, route_prefix=ROUTE, blocking=False)
        wait_replicas(APP, 2)
        APP_ARGS.update(args)
        yield sim, f"http://127.0.0.1:{port}{ROUTE}"
    finally:
        if sim.workers:
            serve.shutdown()
        else:  # every node gone (the last test): Serve would wait for replicas no node can hold
            sim_cluster.discard()


def worker_nodes_of_ranks() -> dict[str, set[str]]:
    """Replica (by its actor's address) -> the nodes of the AttentionWorker actors it owns."""
    import ray

    actors = [a for a in ray._private.state.actors().values() if a["State"] == "ALIVE"]
    replicas = {(a["Address"]["IPAddress"], a["Address"]["Port"]): a["Address"]["NodeID"] for a in actors
                if a["ActorClassName"].startswith(f"ServeReplica:{APP}:LLMServer")}
    out: dict[str, set[str]] = {}
    for a in actors:
        owner = (a["OwnerAddress"]["IPAddress"], a["OwnerAddress"]["Port"])
        if a["ActorClassName"] == "AttentionWorker" and owner in replicas:
            out.setdefault(replicas[owner], set()).add(a["Address"]["NodeID"])
    return out


def test_replicas_spread_over_nodes_with_their_ranks(app):
    sim, _ = app
    nodes = replica_nodes(APP)
    assert len(set(nodes.values())) == 2, f"two replicas on one node: {nodes}"
    assert set(nodes.values()) <= {n.node_id for n in sim.workers}, "a replica on the head node"
    ranks = worker_nodes_of_ranks()
    assert ranks == {node: {node} for node in nodes.values()}, f"ranks apart from their replica: {ranks}"


def generate(i: int, **kw) -> dict:
    return dict({"prompt_token_ids": [3 + i, 7, 11 + i, 5, 9] * 4, "max_tokens": 120, "ignore_eos": True,
                 "stream": True}, **({"temperature": 1.0, "seed": 50 + i} if i % 2 else {}), **kw)


def test_losing_a_node_under_load_loses_no_request(app, time_limit):
    time_limit(scaled(400))
    sim, url = app
    bodies = [generate(i) for i in range(6)]
    chat = {"model": "ray_attn-random", "prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 100, "n": 2,
            "seed": 3, "temperature": 1.0, "ignore_eos": True, "stream": True, "return_token_ids": True}
    whole = dict(generate(99), stream=False)
    clean = [sse_events(url + "/v1/generate", b, timeout=scaled(120))[0] for b in bodies]
    clean_cmpl = sse_events(url + "/v1/completions", chat, timeout=scaled(120))[0]
    clean_whole = httpx.post(url + "/v1/generate", json=whole, timeout=scaled(120)).json()

    started = threading.Barrier(len(bodies) + 2)  # every stream has tokens; then the node goes
    results: dict[object, object] = {}

    def run_stream(key, path, body):
        def on_event(n, replica):
            if n == 2:
                results[("replica", key)] = replica
                started.wait(scaled(120))
        try:
            results[key] = sse_events(url + path, body, on_event, timeout=scaled(180))[0]
        except BaseException as e:  # noqa: BLE001 - reported by the assertions below
            results[key] = e

    threads = [threading.Thread(target=run_stream, args=(i, "/v1/generate", b)) for i, b in enumerate(bodies)]
    threads.append(threading.Thread(target=run_stream, args=("cmpl", "/v1/completions", chat)))
    for t in threads:
        t.start()
    started.wait(scaled(120))
    by_replica = replica_nodes(APP)
    on = [results[("replica", k)] for k in [*range(len(bodies)), "cmpl"]]
    victim = max(set(on), key=on.count)  # the replica with the most streams
    whole_result = {}
    whole_thread = threading.Thread(target=lambda: whole_result.update(
        r=httpx.post(url + "/v1/generate", json=whole, timeout=scaled(180))))
    whole_thread.start()
    t_loss = time.monotonic()
    sim.remove(sim.node_of(by_replica[victim]))
    for t in threads + [whole_thread]:
        t.join(scaled(240))
    lost_s = time.monotonic() - t_loss
    print(f"\nnode of replica {victim} removed under {on.count(victim)} of {len(on)} streams; "
          f"all answered {lost_s:.1f}s later")

    for i, want in enumerate(clean):
        got = results[i]
        assert not isinstance(got, BaseException), f"stream {i}: {got!r}"
        assert got[-1] == "[DONE]" and tokens_of(got) == tokens_of(want), f"stream {i}"
        assert [e["index"] for e in got[:-1]] == [sum(len(x["token_ids"]) for x in got[:j]) for j in range(len(got) - 1)]
    got = results["cmpl"]
    assert not isinstance(got, BaseException), repr(got)
    assert openai_text(got) == openai_text(clean_cmpl)
    r = whole_result["r"]
    assert r.status_code == 200 and r.json()["token_ids"] == clean_whole["token_ids"], r.text

    # The replica no node can hold now is named with what it asks for
    assert len(replica_nodes(APP)) == 1
    from ray_attn.serve.app import deployment_options
    from ray_attn.serve.schemas import ServeAppConfig
    from ray_attn.serve.status import pending_messages

    bundles = deployment_options(ServeAppConfig.model_validate(APP_ARGS))["placement_group_bundles"]
    deadline, messages = time.monotonic() + scaled(60), []
    while time.monotonic() < deadline and not any("wait for a node" in m for m in messages):
        messages = pending_messages(APP, bundles)
        time.sleep(0.5)
    assert any("LLMServer" in m and REPLICA_RESOURCE in m and "full" in m for m in messages), messages
    # Serve replaces the lost replica once a node can hold it, without a restart of the app
    new = sim.add_replica_node()
    nodes = wait_replicas(APP, 2, timeout=180)
    assert new.node_id in nodes.values()
    assert tokens_of(sse_events(url + "/v1/generate", bodies[0], timeout=scaled(120))[0]) == tokens_of(clean[0])


def test_with_every_replica_gone_a_stream_ends_with_an_error_event(app, time_limit):
    time_limit(scaled(300))
    sim, url = app
    wait_replicas(APP, 2, timeout=180)
    gone = threading.Event()

    def on_event(n, replica):
        if n == 2:
            for node in list(sim.workers):
                sim.remove(node)
            gone.set()

    t0 = time.monotonic()
    events, _ = sse_events(url + "/v1/generate", generate(0), on_event, timeout=scaled(200))
    assert gone.is_set()
    assert events[-1] == "[DONE]"
    err = events[-2]
    assert err.get("field") == "replica", err
    assert len(tokens_of(events)) < 120
    print(f"\nevery node removed: the stream ended with an error event after {time.monotonic() - t0:.1f}s")
