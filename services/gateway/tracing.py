"""Request traces: W3C trace context in and out, and optional OTLP/HTTP export of one span per
request following the OpenTelemetry GenAI semantic conventions (v1.38, pinned below), with
`sparseguard.*` attributes and child spans for the upstream call, the probe pass and a
retrieval. Export is off unless `SPARSEGUARD_OTEL__ENDPOINT` is set; the trace id is kept
either way: an incoming `traceparent`'s trace id becomes the request's trace id (X-IR-Trace-ID,
the telemetry event, its Kafka headers, the upstream call)."""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Span, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.status import Status, StatusCode

from services.config import OtelSettings

log = logging.getLogger(__name__)
SEMCONV_SCHEMA = "https://opentelemetry.io/schemas/1.38.0"  # GenAI conventions followed
_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


class TraceParent:
    """A W3C `traceparent`: the trace this request belongs to and the span that called it."""

    def __init__(self, trace_id: str, span_id: str, flags: str = "01") -> None:
        self.trace_id, self.span_id, self.flags = trace_id, span_id, flags

    @classmethod
    def parse(cls, headers: Mapping[str, str]) -> TraceParent | None:
        """The caller's trace context; None when absent or malformed (a new trace starts)."""
        found = _TRACEPARENT.match(headers.get("traceparent", "").strip().lower())
        if found is None or set(found.group(1)) == {"0"} or set(found.group(2)) == {"0"}:
            return None
        return cls(*found.groups())

    @classmethod
    def new(cls) -> TraceParent:
        return cls(secrets.token_hex(16), secrets.token_hex(8))

    def child(self) -> TraceParent:
        """The same trace, a new span id: what this gateway sends on as its own context."""
        return TraceParent(self.trace_id, secrets.token_hex(8), self.flags)

    def header(self) -> str:
        return f"00-{self.trace_id}-{self.span_id}-{self.flags}"

    def context(self) -> Any:
        span = SpanContext(
            int(self.trace_id, 16),
            int(self.span_id, 16),
            is_remote=True,
            trace_flags=TraceFlags(int(self.flags, 16)),
        )
        return trace.set_span_in_context(NonRecordingSpan(span))


class Tracing:
    """Spans exported over OTLP/HTTP in batches; `None`-safe helpers when export is off."""

    def __init__(self, settings: OtelSettings) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        endpoint = str(settings.endpoint).rstrip("/")
        resource = Resource.create({"service.name": settings.service_name}, SEMCONV_SCHEMA)
        self.provider = TracerProvider(resource=resource)
        exporter = OTLPSpanExporter(endpoint=f"{endpoint}/v1/traces", timeout=5)
        self.provider.add_span_processor(
            BatchSpanProcessor(exporter, schedule_delay_millis=settings.export_delay_ms)
        )
        self.tracer = self.provider.get_tracer("sparseguard.gateway", schema_url=SEMCONV_SCHEMA)

    def request_span(self, name: str, parent: TraceParent | None) -> Span:
        """The request's span (kind SERVER), a child of the caller's span when there is one."""
        context = parent.context() if parent is not None else None
        span = self.tracer.start_span(name, context=context, kind=SpanKind.SERVER)
        return span  # type: ignore[return-value]

    def close(self) -> None:
        self.provider.shutdown()  # flushes what is still queued


@contextmanager
def child_span(
    tracing: Tracing | None, parent: Span | None, name: str, kind: SpanKind = SpanKind.INTERNAL
) -> Iterator[Span | None]:
    """A child of the request span for one step (upstream call, probe, retrieval); nothing
    when export is off. Not made the current span: it may live across an async generator's
    yields, where a context token cannot be detached."""
    if tracing is None or parent is None:
        yield None
        return
    context = trace.set_span_in_context(parent)
    span: Span = tracing.tracer.start_span(name, context=context, kind=kind)  # type: ignore[assignment]
    try:
        yield span
    except BaseException as exc:
        span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
        raise
    finally:
        span.end()


def end_span(span: Span | None, attributes: Mapping[str, Any], error: str | None) -> None:
    if span is None:
        return
    span.set_attributes({k: v for k, v in attributes.items() if v is not None})
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end()


def span_parent(span: Span | None, fallback: TraceParent) -> TraceParent:
    """What to send on as `traceparent`: the given span's context, or the request's own."""
    if span is None:
        return fallback.child()
    context = span.get_span_context()
    return TraceParent(f"{context.trace_id:032x}", f"{context.span_id:016x}", "01")
