"""A replica lost under a request: the front sends it to the other replica, and a stream goes
on where it stopped (``resume_requests``, ``ray_attn/serve/resume.py``).

Four replicas (TP=1, the engine in the replica process) behind the front.  Each test runs a
request once without a fault, then again killing -- with ``ray.kill`` -- the replica that
answers it after a few events, and compares what the client received: every token once, in
order, the same text and finish, under one id.  With ``max_request_attempts: 1`` (resumption
off) the same fault ends the stream with an error event, never a cut that looks finished.
Losing a whole node is tested on a multi-node cluster (``tests/cluster``).
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.serve.conftest import LIMITS, MODEL_ID
from tests.serve.helpers import openai_text, sse_events, tokens_of, wait_deleted
from tests.timescale import scaled

pytestmark = pytest.mark.slow
APP, ROUTE = "resume", "/resume"
OFF_APP, OFF_ROUTE = "resume_off", "/resume-off"


# More replicas than a fault needs: each test kills one, and while Serve replaces it the next
# tests' faults still find another replica running to resume on (with two, every other test
# waited for a whole replica start; with three, every third).  That every killed replica was
# replaced is checked once all tests have killed theirs (the fixture's teardown).
REPLICAS = 4


@pytest.fixture(scope="module")
def resume_urls(served):
    from ray import serve
    from ray.serve.api import RunTarget

    from ray_attn.serve.app import build_app
    from tests.serve.helpers import engine_config

    base = dict(LIMITS, max_tokens_limit=1000, executor="in_process", replica_num_cpus=0.5,
                tokenizer=served.tokenizer_dir, served_model_name=MODEL_ID,
                engine=engine_config(tp=1, max_num_seqs=4, eos=True).model_dump(mode="json"),
                resume_requests=True, health_check_timeout_s=scaled(10.0))
    # Both apps at once: serve.run waits for its app to run before the next one is deployed.
    serve.run_many([RunTarget(build_app(dict(base, num_replicas=REPLICAS)), name=APP, route_prefix=ROUTE),
                    RunTarget(build_app(dict(base, num_replicas=1, max_request_attempts=1)), name=OFF_APP,
                              route_prefix=OFF_ROUTE)])
    wait_running(APP, REPLICAS)
    wait_running(OFF_APP, 1)
    try:
        yield served.url + ROUTE, served.url + OFF_ROUTE
    finally:
        serve.delete(OFF_APP, _blocking=False)  # its shutdown overlaps the wait below
        try:
            wait_running(APP, REPLICAS)  # every replica killed under a test was replaced
        finally:
            serve.delete(APP, _blocking=False)
            wait_deleted(APP, OFF_APP)


def wait_running(app: str, replicas: int) -> None:
    from ray import serve

    deadline = time.monotonic() + scaled(120)
    while time.monotonic() < deadline:
        st = serve.status().applications.get(app)
        if st is not None and st.status == "RUNNING":
            states = st.deployments["LLMServer"].replica_states
            if states.get("RUNNING", 0) == replicas and sum(states.values()) == replicas:
                return
        time.sleep(0.2)
    raise TimeoutError(f"{app}: {replicas} replicas not running within {scaled(120):.0f}s: {serve.status()}")


def kill_replica(app: str, unique_id: str) -> None:
    import ray

    actor = ray.get_actor(f"SERVE_REPLICA::{app}#LLMServer#{unique_id}", namespace="serve")
    ray.kill(actor, no_restart=True)


def stream(url: str, path: str, body: dict, kill_after: int | None = None, app: str = APP, resumed=None):
    """The data events of one streamed request (``[DONE]`` last), and the replica that began it;
    with ``kill_after``, that replica is killed once so many events arrived."""
    def kill(n: int, replica: str) -> None:
        if n == kill_after:
            kill_replica(app, replica)

    return sse_events(url + path, body, kill, timeout=scaled(120), resumed=resumed)


def generate_body(**kw) -> dict:
    return dict({"prompt_token_ids": list(range(3, 40)), "max_tokens": 160, "ignore_eos": True,
                 "stream": True}, **kw)


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 123}], ids=["greedy", "seeded"])
def test_generate_stream_resumes_with_every_token_once(resume_urls, sampling):
    url, _ = resume_urls
    body = generate_body(**sampling)
    clean, _ = stream(url, "/v1/generate", body)
    resumed = []
    faulted, victim = stream(url, "/v1/generate", body, kill_after=4, resumed=resumed)
    assert faulted[-1] == "[DONE]" and clean[-1] == "[DONE]"
    # the client is told, in an SSE comment, that another replica carries the stream on
    assert len(resumed) == 1 and resumed[0][0] != victim and resumed[0][1] >= 4, (resumed, victim)
    got, want = tokens_of(faulted), tokens_of(clean)
    assert len(got) == len(want) == body["max_tokens"]
    assert got == want
    # each event's index is the count of tokens before it: no gap, no repeat
    seen = 0
    for e in faulted[:-1]:
        assert e["index"] == seen, (e["index"], seen)
        seen += len(e["token_ids"])
    assert "".join(e["text"] or "" for e in faulted[:-1]) == "".join(e["text"] or "" for e in clean[:-1])
    assert len({e["id"] for e in faulted[:-1]}) == 1
    assert faulted[-2]["finished"] and faulted[-2]["finish_reason"] == clean[-2]["finish_reason"] == "length"


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "the quick brown fox", "n": 2, "seed": 9, "temperature": 1.0,
                         "stop": ["zz"], "return_token_ids": True}),
    ("/v1/completions", {"prompt": "hello there", "echo": True, "temperature": 0, "return_token_ids": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "tell me a story"}], "n": 2,
                              "seed": 4, "temperature": 0.9, "return_token_ids": True}),
], ids=["completions-n2-stop", "completions-echo", "chat-n2"])
def test_openai_stream_resumes_to_the_fault_free_answer(resume_urls, path, body):
    url, _ = resume_urls
    body = dict(body, model=MODEL_ID, max_tokens=120, ignore_eos=True, stream=True,
                stream_options={"include_usage": True})
    clean, _ = stream(url, path, body)
    faulted, _ = stream(url, path, body, kill_after=5)
    assert faulted[-1] == "[DONE]"
    assert openai_text(faulted) == openai_text(clean)
    for o in openai_text(faulted).values():
        assert o["roles"] == (1 if "chat" in path else 0), "the role opens each choice once"
        assert o["finish"] is not None
    ids = {e["id"] for e in faulted if isinstance(e, dict)}
    assert len(ids) == 1, ids
    usage = [e["usage"] for e in faulted if isinstance(e, dict) and e.get("usage")]
    want = [e["usage"] for e in clean if isinstance(e, dict) and e.get("usage")]
    assert len(usage) == 1 and usage[0]["completion_tokens"] == want[0]["completion_tokens"]
    assert usage[0]["prompt_tokens"] == want[0]["prompt_tokens"]


def test_non_streaming_request_is_retried_on_the_other_replica(resume_urls):
    import threading

    url, _ = resume_urls
    # long enough (about a second or more) that it is still running when its replica is found
    body = generate_body(stream=False, max_tokens=1000)
    clean = httpx.post(url + "/v1/generate", json=body, timeout=scaled(120))
    assert clean.status_code == 200
    actors = replica_actors(APP)  # looked up first: the poll below must be quick
    result = {}
    t = threading.Thread(target=lambda: result.update(
        r=httpx.post(url + "/v1/generate", json=body, timeout=scaled(120))))
    t.start()
    victim = wait_busy_replica(actors)  # the replica that holds it, killed while it runs
    kill_replica(APP, victim)
    t.join(scaled(120))
    r = result["r"]
    assert r.status_code == 200, r.text
    assert r.json()["token_ids"] == clean.json()["token_ids"]
    assert r.headers["x-replica-id"] != victim, "the request ended before its replica was killed"


def replica_actors(app: str) -> dict:
    """The app's replica actors by unique id."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#LLMServer#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    return {n[len(prefix):]: ray.get_actor(n, namespace="serve") for n in names}


def wait_busy_replica(actors: dict) -> str:
    """The unique id of the replica with a request in hand (asked of each replica actor: /stats
    would be routed to the idle one).  A replica Serve is still starting in place of one an
    earlier test killed answers once it is up: it is asked again only when it has answered."""
    import ray

    deadline = time.monotonic() + scaled(60)
    asks = {uid: actor.get_num_ongoing_requests.remote() for uid, actor in actors.items()}
    while time.monotonic() < deadline:
        ready, _ = ray.wait(list(asks.values()), num_returns=1, timeout=0.05)
        for uid in [u for u, ref in asks.items() if ref in ready]:
            if ray.get(asks[uid]) > 0:
                return uid
            asks[uid] = actors[uid].get_num_ongoing_requests.remote()
    raise TimeoutError("no replica took the request")


def test_without_resumption_a_lost_stream_ends_with_an_error_event(resume_urls):
    _, off = resume_urls
    # A fault-free run first: the cut stream's tokens must be its beginning.  (Before the front
    # started its node's progress store at start-up, the first stream waited for that store's
    # worker, and the replica had finished all 160 tokens when event 3 reached the client.)
    clean, _ = stream(off, "/v1/generate", generate_body(), app=OFF_APP)
    events, _ = stream(off, "/v1/generate", generate_body(), kill_after=3, app=OFF_APP)
    assert events[-1] == "[DONE]"
    err = events[-2]
    assert isinstance(err, dict) and err.get("field") == "replica" and "not resumed" in err["detail"], err
    got = tokens_of(events)
    assert 3 <= len(got) < 160 and got == tokens_of(clean)[:len(got)]
    wait_running(OFF_APP, 1)
