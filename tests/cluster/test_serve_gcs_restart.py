"""Serve through a GCS that dies and is started again, on a simulated cluster (``conftest.py``)
whose GCS keeps its tables on disk (Ray's RocksDB GCS storage, ``simcluster.start_cluster
(gcs_storage_path=...)``: the part an external Redis plays in Ray's GCS fault tolerance, with
nothing to install).  A head (the GCS, Serve's controller and proxy) and one worker node with
the replica.

- While the GCS is down, the streams in flight go on to ``[DONE]`` on their first connection and
  a new request is answered: the proxy routes on the replica set it holds, and neither it nor
  the replica asks the GCS anything to serve.
- Once it is back it has the cluster as it was: the same replica actor in the same process (no
  restart), Serve's application RUNNING, and actors can be made again.

Without the disk (the default, in memory) a restarted GCS would know no node or actor, and the
raylets give up on it after ``gcs_rpc_server_reconnect_timeout_s`` (docs/serving.md, "What
survives the loss of the head").  The outage here lasts a few seconds, well inside that.
"""

from __future__ import annotations

import time

import httpx
import pytest

from ray_attn.serve.sse_client import faults, stream
from tests.cluster.conftest import REPLICA_RESOURCE, replica_actors, start_serve, wait_replicas
from tests.serve.helpers import engine_config, tokens_of
from tests.timescale import scaled

pytestmark = pytest.mark.slow
APP, ROUTE = "gcsrestart", "/gcs"


def generate(i: int, **kw) -> dict:
    return dict({"prompt_token_ids": [5 + i, 9, 2 + i, 7] * 5, "max_tokens": 160, "ignore_eos": True, "stream": True},
                **({"temperature": 1.0, "seed": 10 + i} if i % 2 else {}), **kw)


STREAMS = {i: generate(i) for i in range(3)}
WHOLE = generate(9, stream=False, max_tokens=24)
OUTAGE_S = 4.0  # the GCS stays down at least this long


@pytest.fixture(scope="module")
def served(sim_cluster, tmp_path_factory):
    from ray import serve

    from ray_attn.serve.app import build_app

    sim = sim_cluster.get(workers=1, gcs_storage_path=str(tmp_path_factory.mktemp("gcs_storage")))
    try:
        port = start_serve("HeadOnly")
        eng = engine_config(tp=1, max_num_seqs=8)
        args = dict(engine=eng.model_dump(mode="json"), executor="in_process", replica_num_cpus=1.0,
                    num_replicas=1, replica_resource=REPLICA_RESOURCE, max_tokens_limit=256,
                    health_check_period_s=1.0, health_check_timeout_s=scaled(10.0))
        serve.run(build_app(args), name=APP, route_prefix=ROUTE, blocking=False)
        wait_replicas(APP, 1)
        yield sim, f"http://127.0.0.1:{port}{ROUTE}"
    finally:
        # the GCS restarted under it: no state of this cluster is for another module
        sim_cluster.discard()


def whole(url: str) -> httpx.Response:
    return httpx.post(url + "/v1/generate", json=WHOLE, timeout=scaled(60))


def test_serving_goes_on_while_the_gcs_is_down_and_the_gcs_comes_back_with_the_cluster(served, time_limit):
    import threading

    import ray
    from ray import serve

    time_limit(scaled(240))
    sim, url = served
    head = sim.cluster.head_node
    clean = {i: tokens_of(stream(url + "/v1/generate", b, reconnect=False, timeout=scaled(60)).events)
             for i, b in STREAMS.items()}
    clean_whole = whole(url).json()["token_ids"]
    before = {uid: a["Pid"] for uid, a in replica_actors(APP).items()}
    assert len(before) == 1

    live: dict = {}
    results: dict = {}

    def one(i, body):
        results[i] = stream(url + "/v1/generate", body, reconnect=False, timeout=scaled(60),
                            on_event=lambda s, i=i: live.__setitem__(i, s))
    threads = [threading.Thread(target=one, args=(i, b), daemon=True) for i, b in STREAMS.items()]
    for t in threads:
        t.start()
    deadline = time.monotonic() + scaled(60)
    while not (len(live) == len(STREAMS) and all(len(s.events) >= 2 for s in live.values())):
        assert time.monotonic() < deadline, "the streams did not start"
        time.sleep(0.02)
    head.kill_gcs_server()
    down_at = time.monotonic()
    try:
        cut_short = {i: n for i, s in live.items() if (n := len(tokens_of(s.events))) >= STREAMS[i]["max_tokens"]}
        answer = whole(url)
        for t in threads:
            t.join(scaled(60))
        # and a while longer, past the clients' first retries of anything that did need it
        time.sleep(max(0.0, down_at + OUTAGE_S - time.monotonic()))
        late = whole(url)
        still_down = head.all_processes.get("gcs_server") is None
        down_for = time.monotonic() - down_at
    finally:
        head.start_gcs_server()
    assert still_down, "the GCS came back before the streams ended: the test proves nothing"
    assert not cut_short, f"streams already done when the GCS was killed: {cut_short}"
    assert not any(t.is_alive() for t in threads), "a stream hung with the GCS down"
    print(f"\nthe GCS was down {down_for:.1f}s: {len(STREAMS)} streams ended and two requests were answered")
    for r in (answer, late):
        assert r.status_code == 200, r.text[:300]
        assert r.json()["token_ids"] == clean_whole
    for i, s in results.items():
        assert s.error is None and s.done, f"stream {i}: {s.error}"
        assert len(s.connections) == 1, f"stream {i} was cut: {s.connections}"
        assert faults(s) == (0, 0)
        assert tokens_of(s.events) == clean[i], f"stream {i} differs from the fault-free run"

    # Back: the cluster as it was, read from disk -- the same replica in the same process
    deadline = time.monotonic() + scaled(60)
    while True:
        try:
            status = serve.status().applications[APP].status
            after = {uid: a["Pid"] for uid, a in replica_actors(APP).items()}
            if status == "RUNNING" and after:
                break
        except Exception as e:  # noqa: BLE001 - the driver's GCS client reconnecting
            status, after = repr(e), None
        assert time.monotonic() < deadline, f"the app after the GCS came back: {status}, replicas {after}"
        time.sleep(0.2)
    assert after == before, f"the replica was restarted: {before} -> {after}"

    @ray.remote(num_cpus=0)
    class Probe:
        def ping(self):
            return "pong"

    probe = Probe.remote()  # a new actor: only a GCS that is up makes one
    assert ray.get(probe.ping.remote(), timeout=scaled(60)) == "pong"
    ray.kill(probe)
    again = whole(url)
    assert again.status_code == 200 and again.json()["token_ids"] == clean_whole
