"""scripts/hostile_burst.py's keyed client (issue 42): ``--keyed-keepalive`` asks over one kept-alive
connection, as the openai SDK's pooled client does; by default each ask opens a fresh one.  Checked
against a local HTTP/1.1 server that records the client port of every request."""

from __future__ import annotations

import queue
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


class _Recorder(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive unless the client closes
    ports: list = []
    auth: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("content-length", 0)))
        type(self).ports.append(self.client_address[1])
        type(self).auth.append(self.headers.get("authorization"))
        body = b'{"token_ids": [1]}'
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("keepalive", [False, True])
def test_the_keyed_client_keeps_one_connection_only_when_asked(keepalive):
    sys.path.insert(0, str(ROOT / "scripts"))
    import hostile_burst

    _Recorder.ports, _Recorder.auth = [], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    ready, stop, results = threading.Event(), threading.Event(), queue.Queue()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/generate"
    poller = threading.Thread(target=hostile_burst.poll_health,
                              args=(url, 0.0, ready, stop, 10.0, results, "K", 2, True, keepalive))
    poller.start()
    try:
        assert ready.wait(10)
        for _ in range(1000):  # until a few asks are in
            if len(_Recorder.ports) >= 5:
                break
            stop.wait(0.01)
    finally:
        stop.set()
        poller.join(10)
        server.shutdown()
    polls, failures = results.get(timeout=10)
    assert failures == 0 and len(polls) >= 5
    assert set(_Recorder.auth) == {"Bearer K"}
    ports = set(_Recorder.ports)
    assert (len(ports) == 1) if keepalive else (len(ports) == len(_Recorder.ports)), _Recorder.ports
