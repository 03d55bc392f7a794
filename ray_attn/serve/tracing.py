"""OpenTelemetry spans per request, sent to an OTLP endpoint (vLLM's ``--otlp-traces-endpoint``).

Off by default, and then free: ``request_log.RequestLog`` holds no tracer, this module is never
imported, and a request records only the few timestamps its log line has anyway.  On
(``otlp_traces_endpoint: http://collector:4318``), each request that ends gives one trace:

- the request's span (``SERVER``; ``POST /v1/completions``), from its first byte in to its last
  byte out, with its id, status, client, tokens in and out; a child of the client's
  ``traceparent`` when it sent one (the front puts one on a request that has none, so every
  replica a resumed request runs on adds to the same trace);
- ``queue``: from the handler handing its engine requests to the engine loop until the engine
  took them in (the loop picks up new requests between steps);
- ``prefill``: from there to its first token -- the scheduler's wait for room in a batch
  included: the engine does not report when it first scheduled a request;
- ``decode``: from the first token to the end of its last engine request;
- ``resume``: on a replica that carries on a stream another replica lost, from handing it to
  the loop to its first new token (the prefill of the prompt plus the tokens already sent).

The spans are made when the request ends, with the times it recorded, so nothing on the
request's path waits on the SDK; a batch processor exports them from its own thread.  The
provider is this module's own, not the process-global one: Ray's own telemetry is left as it is.
"""

from __future__ import annotations

import secrets
from typing import Optional

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

OTLP_PATH = "/v1/traces"


def new_traceparent() -> str:
    """A W3C ``traceparent`` of a fresh trace (sampled)."""
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


def otlp_exporter(endpoint: str):
    """The OTLP/HTTP (protobuf) span exporter for ``endpoint`` (``http://host:4318``; the
    ``/v1/traces`` path is added when missing)."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        raise ValueError("otlp_traces_endpoint: the OTLP exporter is not installed; "
                         "pip install 'ray_attn[otel]' (opentelemetry-exporter-otlp-proto-http)") from None
    if not endpoint.startswith(("http://", "https://")):
        raise ValueError(f"otlp_traces_endpoint: {endpoint[:200]!r} is not an http(s) URL "
                         f"(OTLP over HTTP, e.g. http://localhost:4318)")
    url = endpoint.rstrip("/")
    return OTLPSpanExporter(endpoint=url if url.endswith(OTLP_PATH) else url + OTLP_PATH)


class Tracing:
    """Turns a finished request's :class:`~ray_attn.serve.request_log.RequestRecord` into spans."""

    def __init__(self, exporter, batch: bool = True, service_name: str = "ray_attn"):
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("ray_attn.serve")
        self._propagator = TraceContextTextMapPropagator()

    @classmethod
    def otlp(cls, endpoint: str) -> "Tracing":
        return cls(otlp_exporter(endpoint))

    def record(self, rec) -> None:
        parent = self._propagator.extract({"traceparent": rec.traceparent}) if rec.traceparent else None
        attrs = {"http.request.method": rec.method, "url.path": rec.path, "http.response.status_code": rec.status,
                 "client.address": rec.client, "gen_ai.request.id": rec.request_id,
                 "gen_ai.usage.input_tokens": rec.tokens_in, "gen_ai.usage.output_tokens": rec.tokens_out,
                 "ray_attn.cached_tokens": sum(rec.cached.values()), "ray_attn.engine_requests": len(rec.engine_ids)}
        if rec.resumed_tokens:
            attrs["ray_attn.resumed_tokens"] = rec.resumed_tokens
        if rec.cancelled:
            attrs["ray_attn.cancelled"] = True
        root = self.tracer.start_span(f"{rec.method} {rec.path}", context=parent, kind=SpanKind.SERVER,
                                      start_time=rec.started_ns, attributes=attrs)
        if rec.status >= 500:
            root.set_status(Status(StatusCode.ERROR, f"HTTP {rec.status}"))
        ctx = trace.set_span_in_context(root)
        self._child("queue", ctx, rec.submitted_ns, rec.accepted_ns)
        self._child("prefill", ctx, rec.accepted_ns, rec.first_token_ns)
        self._child("decode", ctx, rec.first_token_ns, rec.finished_ns)
        if rec.resumed_tokens:
            self._child("resume", ctx, rec.submitted_ns, rec.first_token_ns,
                        {"ray_attn.resumed_tokens": rec.resumed_tokens})
        root.end(end_time=rec.ended_ns)

    def _child(self, name: str, ctx, start: Optional[int], end: Optional[int], attrs: Optional[dict] = None) -> None:
        if start is None or end is None or end < start:
            return  # that phase did not happen (refused, cancelled before it, nothing generated)
        self.tracer.start_span(name, context=ctx, start_time=start, attributes=attrs).end(end_time=end)

    def shutdown(self) -> None:
        """Export what is still buffered, then stop."""
        self.provider.shutdown()


__all__ = ["OTLP_PATH", "Tracing", "new_traceparent", "otlp_exporter"]
