"""A keyed app on the real Serve, behind the front (``resume_requests``): what the in-process
tests (test_auth.py, test_request_ids.py) cannot see -- Serve's HTTP proxy (its parser, its own
``X-Request-ID``), the front's key check before it reads a body, Ray's and Serve's log files, and
a second proxy on Serve's port (``api_server_count=2``, serve/api_servers.py).

One app (``/keyed``: the front and one in-process TP=1 replica) on the package's Serve instance.
"""

from __future__ import annotations

import copy
import glob
import json
import os
import socket
import time

import httpx
import pytest

from ray_attn.serve.api_servers import _named_actor_alive as _alive
from tests.serve.app_harness import ADMIN_KEY, API_KEY, OTHER_KEY, raw_request
from tests.serve.helpers import engine_config
from tests.timescale import scaled, wait_for

pytestmark = pytest.mark.slow
WRONG = "sk-e2e-wrong-key-4a91d2"
BIG = "k" * (1 << 20)
BODY = {"model": "keyed", "prompt": [3, 4, 5, 6], "max_tokens": 3, "temperature": 0.0}


@pytest.fixture(scope="module")
def keyed(served):
    from ray import serve

    from ray_attn.serve.app import build_app

    args = dict(executor="in_process", replica_num_cpus=0.5, served_model_name="keyed", resume_requests=True,
                api_keys=[API_KEY, OTHER_KEY], admin_api_keys=[ADMIN_KEY], api_key_env=None, admin_api_key_env=None,
                prefix_router={"ingress_num_cpus": 0.1}, health_check_timeout_s=scaled(10.0), api_server_count=2,
                engine=engine_config(tp=1, max_num_seqs=4, num_blocks=64, eos=True).model_dump(mode="json"))
    serve.run(build_app(args), name="keyed", route_prefix="/keyed", blocking=False)
    url = f"{served.url}/keyed"

    def up():
        try:
            return httpx.get(f"{url}/health", timeout=scaled(5)).status_code == 200
        except httpx.HTTPError:
            return False

    assert wait_for(up, 120), "the keyed app did not come up"
    yield url
    serve.delete("keyed")


def stats(url: str) -> dict:
    return httpx.get(f"{url}/stats", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=scaled(30)).json()


def test_through_serve_every_bad_key_is_our_401_and_nothing_runs(keyed, served):
    before = stats(keyed)
    bad = {"none": None, "wrong": f"Bearer {WRONG}", "basic": f"Basic {API_KEY}", "no scheme": API_KEY,
           "1 MB": f"Bearer {BIG}", "admin key": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=keyed, timeout=scaled(30)) as c:
        for how, auth in bad.items():
            for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/v1/generate"),
                                 ("GET", "/v1/models"), ("POST", "/tokenize"), ("GET", "/metrics")):
                r = c.request(method, path, json=BODY, headers={"Authorization": auth} if auth else {})
                assert r.status_code == 401, (how, path, r.status_code, r.text[:200])
                assert r.headers["www-authenticate"] == "Bearer" and r.json()["field"] == "authorization"
                assert len(r.headers.get_list("x-request-id")) == 1
        assert c.get("/health").status_code == 200
    # headers and a few bytes of a 1,000,000-byte body: the front answers without waiting for it
    port = int(served.url.rsplit(":", 1)[1])
    status, headers, body = raw_request(port, b"POST /keyed/v1/completions HTTP/1.1\r\nHost: x\r\n"
                                              b"Content-Type: application/json\r\nContent-Length: 1000000",
                                        b'{"prompt":', timeout=scaled(20))
    assert status == 401 and json.loads(body)["field"] == "authorization"
    after = stats(keyed)
    assert after["requests_finished"] == before["requests_finished"] and after["in_flight"] == 0
    assert after["connections_open"] == 0  # /stats is not counted; nothing else is open


def test_through_serve_the_key_works_and_the_id_comes_back_once(keyed):
    with httpx.Client(base_url=keyed, timeout=scaled(60)) as c:
        for key in (API_KEY, OTHER_KEY):
            r = c.post("/v1/completions", json=BODY, headers={"Authorization": f"Bearer {key}", "X-Request-Id": "e2e-log-1"})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
            assert r.headers.get_list("x-request-id") == ["e2e-log-1"] and r.json()["id"] == "cmpl-e2e-log-1"
        r = c.post("/v1/generate", json={"prompt_token_ids": [1, 2], "max_tokens": 2},
                   headers={"Authorization": f"Bearer {API_KEY}", "X-Request-Id": "e2e-gen"})
        assert r.json()["id"].startswith("e2e-gen-")  # the engine request's name
        r = c.post("/v1/completions", json=BODY, headers={"Authorization": f"Bearer {API_KEY}"})
        (made,) = r.headers.get_list("x-request-id")  # Serve's proxy made it, and the app used it
        assert r.json()["id"] == f"cmpl-{made}"
        r = c.post("/admin/reload_api_keys", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert r.status_code == 200 and r.json() == {"api_keys": 2, "admin_api_keys": 1}
        assert c.post("/admin/reload_api_keys", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 401


def test_no_key_is_in_rays_or_serves_logs(keyed):
    """Every file of the Ray session's log folder (Serve's proxy, controller and replica logs,
    the workers' output) holds neither a configured key (they travel in the app's config) nor a
    wrong one a client sent -- and the request log lines are in the replicas' Serve logs: the
    answered request's in the LLMServer's, the two refused ones' in Serve's proxy's."""
    import ray

    with httpx.Client(base_url=keyed, timeout=scaled(60)) as c:
        for key in (API_KEY, WRONG, ADMIN_KEY):
            c.post("/v1/completions", json=BODY, headers={"Authorization": f"Bearer {key}", "X-Request-Id": "e2e-grep"})
    logs = ray._private.worker._global_node.get_logs_dir_path()
    needles = [k.encode() for k in (API_KEY, OTHER_KEY, ADMIN_KEY, WRONG)]

    def scan():
        found, lines = [], {}
        for path in glob.glob(os.path.join(logs, "**", "*"), recursive=True):
            if not os.path.isfile(path):
                continue
            with open(path, "rb") as f:
                data = f.read()
            found += [(path, n[:10]) for n in needles if n in data]
            name = os.path.basename(path)
            if name.startswith(("replica_keyed_", "proxy_")):
                kind = "proxy" if name.startswith("proxy_") else \
                    "front" if "PrefixRoutingIngress" in path else "replica"
                route = b"/keyed/v1/completions" if kind == "proxy" else b"/v1/completions"
                for status in (b"200", b"401"):
                    lines[(kind, status.decode())] = lines.get((kind, status.decode()), 0) + data.count(
                        b"request e2e-grep client=127.0.0.1 POST " + route + b" status=" + status)
        return found, lines

    # the two refused by Serve's proxy (proxy_auth.py) or, while its copy of the keys is not
    # read yet, by the front
    want = {("replica", "200"): 1, ("replica", "401"): 0, ("front", "200"): 0, ("proxy", "200"): 0}

    def settled(r):
        return r if {k: v for k, v in r[1].items() if k in want} == want and \
            r[1][("front", "401")] + r[1][("proxy", "401")] == 2 else None

    found, lines = wait_for(lambda: settled(scan()), 30) or scan()
    assert found == []
    assert {k: v for k, v in lines.items() if k in want} == want
    assert lines[("front", "401")] + lines[("proxy", "401")] == 2


def test_health_answers_without_a_key_on_a_socket(keyed, served):
    port = int(served.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=scaled(20)) as s:
        s.sendall(b"GET /keyed/health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 200")


def test_a_burst_without_keys_is_all_401_and_the_keyed_client_is_served_through_it(keyed, tmp_path):
    """scripts/hostile_burst.py --api-key: 200 requests without a key from 20 addresses, each our
    401, while a client with the key asks one generation after another, alone first and then
    through the burst -- none of its asks fails.  Its p99 growth is reported (issue 42's 1.2x is a
    measurement of an idle machine, README "Serving"), not asserted: on a loaded CI box it says
    nothing."""
    import subprocess
    import sys

    from tests.serve.conftest import REPO

    out = tmp_path / "keyed_burst.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "hostile_burst.py"), "--url", keyed, "--api-key", API_KEY,
         "--requests", "200", "--addresses", "20", "--first-address", "200", "--max-tokens", "2", "--idle-s", "3",
         "--timeout", str(scaled(60)), "--health-deadline", str(scaled(60)), "--output", str(out)],
        capture_output=True, text=True, timeout=scaled(180))
    report = json.loads(out.read_text()) if out.exists() else {}
    assert report, proc.stdout + proc.stderr
    assert report.get("ours_401") == 200 and report["foreign"] == 0, report
    assert report["keyed_failures"] == 0 and report["keyed_alone"]["n"] > 0, report
    assert report["keyed_during_burst"]["n"] > 0 and report["keyed_p99_ratio"] > 0, report
    assert API_KEY not in out.read_text()  # the report names no key
    # most of the burst was refused by Serve's proxy itself (proxy_auth.py), not by the front
    import ray

    logs = ray._private.worker._global_node.get_logs_dir_path()

    def by_proxy():
        return sum(open(p, "rb").read().count(b"status=401 tokens_in=0 tokens_out=0 cached=0 resumed=0")
                   for p in glob.glob(os.path.join(logs, "serve", "proxy_*.log")))

    assert wait_for(lambda: by_proxy() >= 150, 30), by_proxy()


def _refused_by(handle) -> int:
    import ray

    from ray_attn.serve.proxy_auth import refused_here

    return ray.get(handle.__ray_call__.remote(lambda self: refused_here()), timeout=scaled(30))


def test_a_second_api_server_shares_the_port_and_refuses_as_serves_proxy_does(keyed):
    """api_server_count=2: one extra proxy on this node, beside Serve's, on the same port.  New
    connections are split between the two by the kernel: of 120 unkeyed requests on fresh
    connections each proxy refuses some itself (proxy_auth.py), every answer our 401; keyed
    requests through both are served."""
    import ray

    from ray_attn.serve.api_servers import _serve_proxy_name, api_server_name

    node = ray.get_runtime_context().get_node_id()
    name = api_server_name(node, 1)
    assert wait_for(lambda: _alive(name), 60), f"{name} was not started"
    extra = ray.get_actor(name, namespace="serve")
    ray.get(extra.ready.remote(), timeout=scaled(60))
    serves = ray.get_actor(_serve_proxy_name(node), namespace="serve")
    unkeyed = {"Authorization": f"Bearer {WRONG}"}
    for _ in range(6):  # each proxy reads the keys' table on its first request
        httpx.post(f"{keyed}/v1/completions", json=BODY, headers=unkeyed, timeout=scaled(30))
    time.sleep(1.5)  # their reads (REFRESH_EVERY_S) land; a request before that goes on to the front
    before = [_refused_by(serves), _refused_by(extra)]
    for _ in range(120):  # a fresh connection each: the kernel picks a listener per connection
        r = httpx.post(f"{keyed}/v1/completions", json=BODY, headers=unkeyed, timeout=scaled(30))
        assert r.status_code == 401 and r.json()["field"] == "authorization", r.text[:200]
    share = [_refused_by(serves) - before[0], _refused_by(extra) - before[1]]
    assert all(n > 0 for n in share) and sum(share) <= 120, share
    for _ in range(8):
        r = httpx.post(f"{keyed}/v1/completions", json=BODY, headers={"Authorization": f"Bearer {API_KEY}"},
                       timeout=scaled(60))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text[:200]
    assert ray.get(extra.leaving.remote(), timeout=scaled(30)) is None


def _api_server(name: str, port: int, **kw):
    """An ``ApiServer`` by hand, on ``port`` of this node, with the package Serve's options."""
    import ray
    from ray.serve.schema import LoggingConfig

    from ray_attn.serve.api_servers import api_server_class

    controller = ray.get_actor("SERVE_CONTROLLER_ACTOR", namespace="serve")
    http = copy.deepcopy(ray.get(controller.get_http_config.remote(), timeout=scaled(30)))
    http.port = port

    return api_server_class().options(name=name, namespace="serve", num_cpus=0, max_concurrency=1000).remote(
        http, node_id=ray.get_runtime_context().get_node_id(), node_ip_address="127.0.0.1",
        logging_config=LoggingConfig(), watch_every_s=0.2, **kw)


def test_an_api_server_leaves_when_serves_proxy_is_gone_or_it_cannot_listen(served):
    """The watchdog's other two ways out: no Serve proxy of the name it watches (serve.shutdown),
    and a port it cannot share (taken without SO_REUSEPORT): each extra ends by itself."""
    import ray

    from tests.serve.conftest import free_port

    orphan = _api_server("RAY_ATTN_TEST_ORPHAN", free_port(), serve_proxy_name="SERVE_PROXY_ACTOR-no-such-node")
    ray.get(orphan.ready.remote(), timeout=scaled(60))  # it listened, then found no Serve proxy
    assert wait_for(lambda: not _alive("RAY_ATTN_TEST_ORPHAN"), scaled(30))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        blocked = _api_server("RAY_ATTN_TEST_BLOCKED", taken.getsockname()[1])
        with pytest.raises(Exception, match="Failed to bind"):
            ray.get(blocked.ready.remote(), timeout=scaled(60))
        assert wait_for(lambda: not _alive("RAY_ATTN_TEST_BLOCKED"), scaled(30))
    # Nor does a keeper make one where the controller still lists a proxy that is gone (a lost
    # node, serve.shutdown under way): a node id with no Serve proxy gets nothing.
    from ray_attn.serve.api_servers import ApiServerKeeper

    keeper = ApiServerKeeper(1)  # its own rounds make nothing (count 1); the one call below is the test
    try:
        assert keeper._get_or_create("RAY_ATTN_TEST_NO_PROXY", "ab" * 28) is None
        assert not _alive("RAY_ATTN_TEST_NO_PROXY")
    finally:
        keeper.close()


def _refuses(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_a_leaving_api_server_stops_listening_and_finishes_the_stream_it_holds(served):
    """Nothing lost when an extra leaves: the actor it watches as its node's Serve proxy is killed
    while it streams a 128-token completion; it stops taking connections before the stream ends,
    the stream still arrives whole, and the extra exits after it."""
    import ray

    from tests.serve.conftest import MODEL_ID, free_port

    @ray.remote(num_cpus=0)
    class Watched:
        def ping(self):
            return True

    watched = Watched.options(name="RAY_ATTN_TEST_WATCHED", namespace="serve").remote()
    ray.get(watched.ping.remote(), timeout=scaled(60))
    port = free_port()
    extra = _api_server("RAY_ATTN_TEST_DRAINING", port, serve_proxy_name="RAY_ATTN_TEST_WATCHED")
    ray.get(extra.ready.remote(), timeout=scaled(60))

    def routed():  # the route table reaches it by long poll, after ready
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=scaled(10)).status_code == 200
        except httpx.HTTPError:
            return False

    assert wait_for(routed, scaled(30))
    body = {"model": MODEL_ID, "prompt": [3, 4, 5], "max_tokens": 128, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    refused_before_end, usage, done = False, None, False
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=scaled(120)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            if usage is None and chunk.get("choices"):  # the first token: the extra starts leaving
                usage = {}
                ray.kill(watched)
            if chunk.get("usage"):
                usage = chunk["usage"]
            refused_before_end = refused_before_end or _refuses(port)
    assert refused_before_end, "the leaving extra still took connections when the stream ended"
    assert done and usage["completion_tokens"] == 128, usage
    assert wait_for(lambda: not _alive("RAY_ATTN_TEST_DRAINING"), scaled(30))


def test_the_extra_api_servers_leave_with_the_app(keyed):
    """Last in the file: the app deleted, no replica renews the extra's lease (api_servers.LEASE_S),
    and it stops listening and exits by itself."""
    import ray
    from ray import serve

    from ray_attn.serve.api_servers import LEASE_S, api_server_name

    name = api_server_name(ray.get_runtime_context().get_node_id(), 1)
    assert _alive(name)
    serve.delete("keyed")
    assert wait_for(lambda: not _alive(name), scaled(LEASE_S + 30)), f"{name} outlived its app"
