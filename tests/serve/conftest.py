"""One real Serve instance on loopback for the serve tests (and the load-test script test).

Two apps on one HTTP port: ``/`` is the TP=2 app (Ray worker actors in the replica's placement
group, with a byte-level BPE tokenizer and a ChatML template trained in the test), ``/plain`` is a
TP=1 in-process app without a tokenizer.  Both end at the tokenizer's EOS, as the direct engine does.
``/plain`` has small connection bounds and a short body timeout (``FRONT``) for the hostile-client
tests; ``/`` has room for the concurrent tests of one client.  Every deadline is ``scaled``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.timescale import scaled
from tests.tokenizer_fixture import build_tokenizer
from ray_attn.ports import loopback_port as free_port

REPO = Path(__file__).resolve().parents[2]

# Small limits so that the catalogue can reach them cheaply.
# 640 prompt tokens: a chat with two tools' schemas is ~450 with the test tokenizer.
LIMITS = dict(max_prompt_tokens=640, max_tokens_limit=128, max_stop_token_ids=4, max_queue_depth=4,
              max_body_bytes=4096, retry_after_s=2)
# The TP=2 app takes 37 requests at once from one client (tests/serve/test_serve_app.py).
MAIN_BOUNDS = dict(max_connections=64, max_requests_per_client=64)
# The /plain app's bounds (tests/serve/test_front.py): reachable with a few raw sockets.
FRONT = dict(max_connections=12, max_requests_per_client=4, body_timeout_s=round(scaled(2.0), 1),
             max_body_bytes=1 << 20)
MAX_NUM_SEQS = 4
MODEL_ID = "tiny-chat"


@dataclass
class Served:
    url: str
    plain_url: str
    args: dict
    tokenizer_dir: str

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=scaled(kw.pop("timeout", 60)), **kw)


@pytest.fixture(scope="package")
def ray_session(shared_ray):
    """The run's one embedded Ray (tests/shared_ray.py): replicas and workers import `ray_attn`
    from this checkout (PYTHONPATH), metrics are reported every second."""
    yield


@pytest.fixture(scope="package")
def served(ray_session, tmp_path_factory):
    from ray import serve
    from ray.serve.api import RunTarget

    from ray_attn.serve.app import build_app
    from tests.serve.helpers import engine_config

    tok_dir = tmp_path_factory.mktemp("tokenizer")
    eng = engine_config(tp=2, max_num_seqs=MAX_NUM_SEQS, eos=True)
    build_tokenizer(tok_dir, eng.model.vocab_size)
    # A ping that misses its deadline on a busy machine fails check_health, and three in a row
    # make Serve replace a healthy replica under the next test: the deadlines are scaled.
    args = dict(LIMITS, **MAIN_BOUNDS, engine=eng.model_dump(mode="json"), tokenizer=str(tok_dir),
                served_model_name=MODEL_ID, replica_num_cpus=0.5, tool_call_parser="hermes", health_check_period_s=1.0,
                health_check_timeout_s=scaled(10.0), health_ping_timeout_s=scaled(5.0))
    # /plain is strict about request fields (strict_request_fields), / is not (the default)
    plain = dict(LIMITS, **FRONT, executor="in_process", replica_num_cpus=0.5, strict_request_fields=True,
                 health_check_timeout_s=scaled(10.0),
                 engine=engine_config(tp=1, max_num_seqs=MAX_NUM_SEQS, eos=True).model_dump(mode="json"))
    port = free_port()
    t0 = time.perf_counter()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    # Both apps at once (serve.run waits for its app to run before the next one is deployed).
    serve.run_many([RunTarget(build_app(args), name="ray_attn", route_prefix="/"),
                    RunTarget(build_app(plain), name="plain", route_prefix="/plain")])
    print(f"\nServe apps up in {time.perf_counter() - t0:.1f}s on port {port}")
    try:
        yield Served(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}/plain", args, str(tok_dir))
    finally:
        serve.shutdown()


@pytest.fixture(scope="package")
def direct_engine(ray_session):
    """The engine the app runs (same config, TP=2 worker actors), driven directly."""
    from ray_attn.engine import LLMEngine
    from tests.serve.helpers import engine_config

    eng = LLMEngine(engine_config(tp=2, max_num_seqs=MAX_NUM_SEQS, eos=True))
    yield eng
    eng.shutdown()
