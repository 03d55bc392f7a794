"""``api_server_count`` on a simulated multi-node cluster (``conftest.py``): Serve's proxies on
every node that runs a replica and on the head (``proxy_location="EveryNode"``), two replicas
(one per worker node), ``api_server_count=2``.  What one node cannot show (the one-node cases
are in tests/serve/test_exposed_serve.py):

- every node with a Serve proxy gets its extra proxy, placed on that node, and no other node does;
- a node lost with its replica, proxy and extra: the keepers on the other nodes go on, nothing is
  made for the lost node, and requests are served throughout;
- a node that joins and takes the replica back gets its proxy from Serve and its extra from the
  keepers, without a restart of the app.

All the simulated nodes listen on 127.0.0.1, so every proxy and extra shares the one port
(SO_REUSEPORT): a request on a fresh connection may reach any of them, and each must serve it.
"""

from __future__ import annotations

import httpx
import pytest

from ray_attn.serve.api_servers import PREFIX, api_server_name, serve_proxy_nodes
from tests.cluster.conftest import REPLICA_RESOURCE, alive_named_actors, replica_nodes, start_serve, wait_replicas
from tests.serve.helpers import engine_config
from tests.timescale import scaled, wait_for

pytestmark = pytest.mark.slow
APP, ROUTE = "apiservers", "/api"


@pytest.fixture(scope="module")
def app(sim_cluster):
    from ray import serve

    from ray_attn.serve.app import build_app

    sim = sim_cluster.get(workers=2)
    try:
        port = start_serve("EveryNode")
        args = dict(engine=engine_config(tp=1, max_num_seqs=4).model_dump(mode="json"), executor="in_process",
                    replica_num_cpus=1.0, num_replicas=2, replica_resource=REPLICA_RESOURCE, api_server_count=2,
                    max_tokens_limit=64, health_check_period_s=1.0, health_check_timeout_s=scaled(10.0))
        serve.run(build_app(args), name=APP, route_prefix=ROUTE, blocking=False)
        wait_replicas(APP, 2)
        yield sim, f"http://127.0.0.1:{port}{ROUTE}"
    finally:
        if len(sim.workers) == 2:
            serve.shutdown()
        else:  # a node lost and not replaced: Serve would wait for a replica no node can hold
            sim_cluster.discard()


def extras() -> dict[str, str]:
    """Each live extra proxy: its name -> the node it runs on."""
    return {name: a["Address"]["NodeID"] for name, a in alive_named_actors(PREFIX).items()}


def settled_proxy_nodes() -> set[str]:
    """The nodes Serve runs a proxy on (as the keepers read them) once each has its one extra
    beside it and no other node has one; empty until then."""
    nodes = serve_proxy_nodes()
    return nodes if extras() == {api_server_name(n, 1): n for n in nodes} else set()


def wait_settled(ok=lambda nodes: True) -> set[str]:
    """``settled_proxy_nodes()`` once they satisfy ``ok`` (polled for up to 60 s, scaled); empty if never."""
    def poll():
        nodes = settled_proxy_nodes()
        return nodes if nodes and ok(nodes) else set()

    return wait_for(poll, 60, every=0.5)


def served_on_fresh_connections(url: str, n: int = 12) -> list[int]:
    codes = []
    for i in range(n):  # a client each: a new connection, which the kernel gives to any listener
        with httpx.Client(timeout=scaled(60)) as c:
            r = c.post(f"{url}/v1/generate", json={"prompt_token_ids": [3 + i, 5, 7], "max_tokens": 2})
            codes.append(r.status_code)
    return codes


def test_each_proxy_node_gets_its_extra_and_a_lost_or_joining_node_is_followed(app, time_limit):
    time_limit(scaled(300))
    sim, url = app
    nodes = set(replica_nodes(APP).values())
    assert len(nodes) == 2  # one replica on each worker node
    assert nodes < wait_settled(), (serve_proxy_nodes(), extras())  # the head's proxy too
    assert served_on_fresh_connections(url) == [200] * 12

    # A worker node lost with its replica, its proxy and its extra.
    victim = sim.node_of(next(iter(nodes)))
    sim.remove(victim)
    assert wait_settled(lambda p: victim.node_id not in p), (serve_proxy_nodes(), extras())
    assert not any(victim.node_id in name for name in extras())
    assert served_on_fresh_connections(url) == [200] * 12

    # A node joins: Serve puts the replica back there, then its proxy; the keepers its extra.
    joined = sim.add_replica_node()
    wait_replicas(APP, 2)
    assert wait_settled(lambda p: joined.node_id in p), (serve_proxy_nodes(), extras())
    assert len(extras()) == 3
    assert served_on_fresh_connections(url) == [200] * 12
