"""OpenTelemetry spans per request, through the app itself (``tests/serve/app_harness.py``):
the SDK's in-memory exporter for their shape, an OTLP/HTTP collector on loopback for the way
out, and the module never imported while tracing is off."""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ray_attn.serve.resume import EXTENSION, ChoiceProgress, Resume
from ray_attn.serve.tracing import Tracing, new_traceparent
from tests.serve.app_harness import API_KEY, asgi_call, bearer, client, completion, in_replica, keyed_server

__all__ = ["in_replica"]
AUTH = ("authorization", f"Bearer {API_KEY}")


@pytest.fixture
def traced(in_replica, monkeypatch):
    """The shared keyed server with tracing on, into an in-memory exporter."""
    srv = in_replica(keyed_server())
    exporter = InMemorySpanExporter()
    monkeypatch.setattr(srv.requests, "tracing", Tracing(exporter, batch=False))
    return srv, exporter


def spans_by_name(exporter) -> dict:
    out = {}
    for s in exporter.get_finished_spans():
        out.setdefault(s.name, []).append(s)
    return out


def test_a_completion_gives_queue_prefill_and_decode_under_its_request_span(traced):
    srv, exporter = traced
    with client() as c:
        r = c.post("/v1/completions", json=completion(max_tokens=5), headers=bearer(API_KEY) | {"X-Request-Id": "tr-1"})
    assert r.status_code == 200
    spans = spans_by_name(exporter)
    assert set(spans) == {"POST /v1/completions", "queue", "prefill", "decode"}
    (root,) = spans["POST /v1/completions"]
    q, p, d = spans["queue"][0], spans["prefill"][0], spans["decode"][0]
    assert root.parent is None and all(s.parent.span_id == root.context.span_id for s in (q, p, d))
    assert {s.context.trace_id for s in (q, p, d)} == {root.context.trace_id}
    # the phases follow one another inside the request
    assert root.start_time <= q.start_time <= q.end_time <= p.start_time <= p.end_time <= d.start_time
    assert d.end_time <= root.end_time
    a = root.attributes
    assert a["gen_ai.request.id"] == "tr-1" and a["http.response.status_code"] == 200
    assert a["gen_ai.usage.input_tokens"] == 6 and a["gen_ai.usage.output_tokens"] == 5
    assert a["client.address"] == "10.1.2.3" and a["ray_attn.engine_requests"] == 1


def test_a_client_trace_context_is_the_parent(traced):
    _, exporter = traced
    parent = new_traceparent()
    trace_id, span_id = int(parent.split("-")[1], 16), int(parent.split("-")[2], 16)
    with client() as c:
        c.post("/v1/generate", json={"prompt_token_ids": [1, 2, 3], "max_tokens": 2},
               headers=bearer(API_KEY) | {"traceparent": parent})
    (root,) = spans_by_name(exporter)["POST /v1/generate"]
    assert root.context.trace_id == trace_id and root.parent.span_id == span_id


def test_a_refused_request_is_one_span_with_its_status(traced):
    srv, exporter = traced
    a = asgi_call("POST", "/v1/completions", [], json.dumps(completion()).encode())
    assert a.status == 401
    (only,) = exporter.get_finished_spans()
    assert only.name == "POST /v1/completions" and only.attributes["http.response.status_code"] == 401
    assert only.attributes["gen_ai.usage.input_tokens"] == 0


def test_a_resumed_stream_has_a_resume_span(traced):
    srv, exporter = traced
    resume = Resume({"id": "cmpl-lost", "created": 1}, {0: ChoiceProgress([17, 18, 19])}).to_json()
    a = asgi_call("POST", "/v1/completions", [AUTH], json.dumps(completion(max_tokens=6, stream=True)).encode(),
                  extensions={EXTENSION: {"resumable": True, "resume": resume}})
    assert a.status == 200 and b"[DONE]" in a.body
    spans = spans_by_name(exporter)
    (res,), (root,), (pre,) = spans["resume"], spans["POST /v1/completions"], spans["prefill"]
    assert res.attributes["ray_attn.resumed_tokens"] == 3 and root.attributes["ray_attn.resumed_tokens"] == 3
    assert res.parent.span_id == root.context.span_id and res.end_time == pre.end_time
    assert root.attributes["gen_ai.usage.output_tokens"] == 3  # the three that were left


def test_tracing_off_never_imports_the_tracing_module(in_replica, monkeypatch):
    """With tracing off a request never reaches for the module: poisoned in sys.modules, any
    import of it would fail the request.  Turning tracing on with it poisoned fails, so the
    poison would bite."""
    srv = in_replica(keyed_server())
    assert srv.requests.tracing is None
    monkeypatch.setitem(sys.modules, "ray_attn.serve.tracing", None)
    with client() as c:
        assert c.post("/v1/completions", json=completion(), headers=bearer(API_KEY)).status_code == 200
    from ray_attn.serve.request_log import RequestLog
    from ray_attn.serve.schemas import ServeAppConfig

    with pytest.raises(ImportError):
        RequestLog.from_config(ServeAppConfig(otlp_traces_endpoint="http://127.0.0.1:4318"))


class _Collector(BaseHTTPRequestHandler):
    got: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).got.append((self.path, self.headers.get("Content-Type"), body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *a):
        pass


def test_spans_reach_an_otlp_http_collector():
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter")
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from ray_attn.serve.request_log import RequestRecord

    httpd = HTTPServer(("127.0.0.1", 0), _Collector)
    _Collector.got = []
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        tracing = Tracing.otlp(f"http://127.0.0.1:{httpd.server_port}")
        rec = RequestRecord("otlp-1", "10.0.0.1", "POST", "/v1/completions", status=200, tokens_in=3, tokens_out=2)
        rec.submitted_ns, rec.accepted_ns = rec.started_ns + 10, rec.started_ns + 20
        rec.first_token_ns, rec.finished_ns, rec.ended_ns = rec.started_ns + 30, rec.started_ns + 40, rec.started_ns + 50
        tracing.record(rec)
        tracing.shutdown()  # flushes the batch
    finally:
        httpd.shutdown()
    (path, ctype, body), = _Collector.got
    assert path == "/v1/traces" and ctype == "application/x-protobuf"
    req = ExportTraceServiceRequest.FromString(body)
    names = {s.name for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans}
    assert names == {"POST /v1/completions", "queue", "prefill", "decode"}
    service = {a.value.string_value for rs in req.resource_spans for a in rs.resource.attributes if a.key == "service.name"}
    assert service == {"ray_attn"}


def test_a_bad_endpoint_is_an_error_naming_the_field():
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter")
    with pytest.raises(ValueError, match="otlp_traces_endpoint: 'grpc://x:4317' is not an http"):
        Tracing.otlp("grpc://x:4317")
