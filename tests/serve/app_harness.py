"""The Serve app's own ASGI app in this process, without Ray: every route and middleware of
``ray_attn.serve.app.fastapi_app`` on a real ``LLMServer`` (an in-process TP=1 engine on CPU),
with the replica context Serve would give the routes patched in.

``served_app(**cfg)`` builds one server per config (about a second) and keeps it for the test
run: the modules that use the same config share it.  ``client()`` is a starlette TestClient;
``uvicorn_url()`` serves the same app through uvicorn on loopback, with the HTTP parser Serve's
proxy uses (``http="auto"``: httptools when installed), for what a client on a socket gets.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import pytest

from tests.serve.helpers import engine_config

MODEL_ID = "exposed"
API_KEY = "sk-test-0123456789abcdef"
OTHER_KEY = "sk-test-rotated-fedcba9876543210"
ADMIN_KEY = "admin-test-5f2b9c0e7d1a"
PROMPT = [5, 6, 7, 8, 9, 10]
_servers: dict = {}


def base_config(**over) -> dict:
    cfg = dict(executor="in_process", replica_num_cpus=0.5, served_model_name=MODEL_ID, max_queue_depth=4,
               api_key_env=None, admin_api_key_env=None,
               engine=engine_config(tp=1, max_num_seqs=4, num_blocks=64, eos=True).model_dump(mode="json"))
    return cfg | over


def _user_class():
    from ray_attn.serve.app import LLMServer

    # Serve's wrapper (ASGIIngressWrapper) subclasses the class the module wrote; that one
    # constructs as a plain object.
    return LLMServer.func_or_class.__mro__[1]


def _shutdown() -> None:
    for srv in _servers.values():
        srv.loop.stop()
        srv.executor.shutdown()
    _servers.clear()


def served_app(**cfg):
    """The LLMServer for ``base_config(**cfg)``, built once per config in this process."""
    key = json.dumps(cfg, sort_keys=True, default=str)
    if key not in _servers:
        if not _servers:
            atexit.register(_shutdown)
        with replica(None):
            srv = _user_class()(base_config(**cfg))
        # No Serve proxy here to answer X-Request-ID (request_log.py): the app always adds it.
        srv.requests.proxy_echoes_id = False
        _servers[key] = srv
    return _servers[key]


def keyed_server():
    """The server the auth, request-id and tracing tests share: two API keys (rotation) and an
    admin key, all in the config."""
    return served_app(api_keys=[API_KEY, OTHER_KEY], admin_api_keys=[ADMIN_KEY])


@contextmanager
def replica(server):
    """``serve.get_replica_context()`` answering as Serve's does inside ``server``'s replica."""
    import ray.serve as serve

    ctx = SimpleNamespace(servable_object=server, replica_id=SimpleNamespace(unique_id="test-replica"),
                          app_name="test", deployment="LLMServer")
    saved = serve.get_replica_context
    serve.get_replica_context = lambda: ctx
    try:
        yield ctx
    finally:
        serve.get_replica_context = saved


@pytest.fixture
def in_replica():
    """Use as ``in_replica(server)``: the app's routes and middlewares serve ``server``."""
    stack = []

    def enter(server):
        cm = replica(server)
        cm.__enter__()
        stack.append(cm)
        return server

    yield enter
    while stack:
        stack.pop().__exit__(None, None, None)


def client(client_addr=("10.1.2.3", 40000)):
    from starlette.testclient import TestClient

    from ray_attn.serve.app import fastapi_app

    return TestClient(fastapi_app, client=client_addr, raise_server_exceptions=True)


@dataclass
class Answer:
    status: int
    headers: dict  # lower-case names; repeated ones joined by ', '
    body: bytes
    body_read: bool  # the app called receive() for the body

    def json(self):
        return json.loads(self.body)


def asgi_call(method: str, path: str, headers=(), body: bytes = b"", client_addr=("10.1.2.3", 40000),
              extensions: Optional[dict] = None) -> Answer:
    """One request straight into the app's ASGI callable, recording whether it read the body."""
    from ray_attn.serve.app import fastapi_app

    read, sent = [], []

    async def run():
        done = asyncio.Event()

        async def receive():
            if read:  # asked again (a stream waits for a disconnect): once the answer is out
                await done.wait()
                return {"type": "http.disconnect"}
            read.append(True)
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message):
            sent.append(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                done.set()

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
                 "headers": [(k.lower().encode(), v if isinstance(v, bytes) else v.encode("latin-1"))
                             for k, v in headers],
                 "client": client_addr, "server": ("testserver", 80)}
        if extensions is not None:
            scope["extensions"] = extensions
        await fastapi_app(scope, receive, send)

    asyncio.run(run())
    start = next(m for m in sent if m["type"] == "http.response.start")
    out: dict = {}
    for k, v in start.get("headers", ()):
        k, v = k.decode().lower(), v.decode("latin-1")
        out[k] = f"{out[k]}, {v}" if k in out else v
    return Answer(start["status"], out, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"),
                  bool(read))


def engine_counts(server) -> dict:
    """What the server's engine loop took in: requests finished and in flight."""
    s = server.loop.stats()
    return {"finished": s["requests_finished"], "in_flight": s["in_flight"], "rejected": s["requests_rejected_full"]}


def completion(max_tokens: int = 4, **kw) -> dict:
    """A greedy completion (sampled ones could end early at EOS)."""
    return dict({"model": MODEL_ID, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0}, **kw)


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


# ------------------------------------------------------------------------------ over a socket
@contextmanager
def uvicorn_url():
    """The app behind uvicorn on loopback (``http="auto"``, as Serve's proxy runs it), yielding
    its URL; the replica context patched by the caller stays in force (it is process-wide)."""
    import uvicorn

    from ray_attn.serve.app import fastapi_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(fastapi_app, http="auto", lifespan="off", log_level="critical",
                                           access_log=False))
    server.install_signal_handlers = lambda: None
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", port
    finally:
        server.should_exit = True
        thread.join(10)


def raw_request(port: int, head: bytes, body: bytes = b"", timeout: float = 30.0) -> tuple[int, dict, bytes]:
    """Send ``head`` (request line and headers, no blank line) and ``body``; the status, headers
    (lower-case names; repeated ones joined by ', ') and body of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head + b"\r\n\r\n" + body)
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
        head_out, _, rest = buf.partition(b"\r\n\r\n")
        lines = head_out.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers: dict = {}
        for ln in lines[1:]:
            k, _, v = ln.partition(":")
            k = k.strip().lower()
            headers[k] = f"{headers[k]}, {v.strip()}" if k in headers else v.strip()
        want = int(headers.get("content-length", 0))
        while len(rest) < want:
            chunk = s.recv(65536)
            if not chunk:
                break
            rest += chunk
        return status, headers, rest
