"""Traces: the gateway exports one span per request over OTLP/HTTP to a receiver on loopback
that decodes the protobuf with `opentelemetry-proto` (a stand-in for an OpenTelemetry
collector, which cannot run here), honours an incoming W3C `traceparent` and passes the trace
on to the upstream (a stand-in OpenAI-compatible server) and into the telemetry event's
Kafka headers."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from services.config import OtelSettings
from services.shared.serving import serve
from services.telemetry.schema import to_record
from tests.gateway_fixtures import RecordingSink, running_gateway, settings_for
from tests.polling import wait_until
from tests.tiny import tiny_engine

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
Spans = list[dict[str, Any]]


def otlp_receiver(spans: Spans) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/traces")
    async def traces(request: Request) -> Response:
        export = ExportTraceServiceRequest()
        export.ParseFromString(await request.body())
        for resource in export.resource_spans:
            for scope in resource.scope_spans:
                for span in scope.spans:
                    spans.append(
                        {
                            "name": span.name,
                            "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent": span.parent_span_id.hex(),
                            "kind": span.kind,
                            "attributes": {a.key: _value(a.value) for a in span.attributes},
                        }
                    )
        return Response(ExportTraceServiceRequest().SerializeToString())

    return app


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


def upstream(headers: list[dict[str, str]]) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def complete(request: Request) -> StreamingResponse:
        headers.append(dict(request.headers))

        async def chunks() -> AsyncIterator[bytes]:
            chunk = {"choices": [{"index": 0, "delta": {"content": "Paris."}}]}
            yield f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def spans() -> Iterator[Spans]:
    found: Spans = []
    with serve(otlp_receiver(found)) as url:
        found.append({"receiver": url})
        yield found


def _otel(spans: Spans) -> OtelSettings:
    return OtelSettings(endpoint=spans[0]["receiver"], export_delay_ms=50)


def _of(spans: Spans, trace: str) -> Spans:
    return [s for s in spans[1:] if s["trace_id"] == trace]


def _one(found: Spans, name: str, kind: int) -> dict[str, Any]:
    (span,) = [s for s in found if s["name"] == name and s["kind"] == kind]
    return span


INTERNAL, SERVER, CLIENT = 1, 2, 3  # OTLP span kinds


def test_proxy_request_is_one_trace_from_caller_to_upstream_and_telemetry(
    tmp_path: Path, spans: Spans
) -> None:
    seen: list[dict[str, str]] = []
    sink = RecordingSink()
    with serve(upstream(seen)) as up:
        settings = settings_for(tmp_path, mode="proxy", upstream_url=f"{up}/v1")
        settings.otel = _otel(spans)
        with running_gateway(settings, tiny_engine(), sink) as url:
            response = httpx.post(
                f"{url}/v1/chat/completions",
                json={"model": "up-model", "messages": [{"role": "user", "content": "Capital?"}]},
                headers={"traceparent": f"00-{TRACE}-{CALLER_SPAN}-01"},
                timeout=30,
            )
            assert response.status_code == 200, response.text
            wait_until(lambda: len(_of(spans, TRACE)) >= 3, timeout_s=10)
    assert response.headers["x-ir-trace-id"] == TRACE
    found = _of(spans, TRACE)
    request = _one(found, "chat up-model", SERVER)
    assert request["parent"] == CALLER_SPAN
    attrs = request["attributes"]
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.model"] == "up-model"
    assert attrs["gen_ai.usage.input_tokens"] > 0 and attrs["gen_ai.usage.output_tokens"] > 0
    assert attrs["gen_ai.response.finish_reasons"] == ["stop"]
    assert attrs["sparseguard.mode"] == "proxy" and attrs["sparseguard.level"] == "balanced"
    assert 0 < attrs["sparseguard.sparsity_ratio"] < 1 and "sparseguard.trust_score" in attrs
    client = _one(found, "chat up-model", CLIENT)
    probe = _one(found, "probe", INTERNAL)
    assert client["parent"] == request["span_id"] and probe["parent"] == request["span_id"]
    # The upstream was asked within the same trace, by the gateway's client span.
    forwarded = seen[-1]["traceparent"].split("-")
    assert forwarded[1] == TRACE and forwarded[2] == client["span_id"]
    # The telemetry event carries the trace, in its body and as a Kafka header.
    event = sink.by_trace(TRACE)
    _, _, headers = to_record(event)
    assert dict(headers)["traceparent"].decode().split("-")[1] == TRACE


def test_serve_mode_trace_id_is_the_span_trace_without_a_caller(
    tmp_path: Path, spans: Spans
) -> None:
    settings = settings_for(tmp_path)
    settings.otel = _otel(spans)
    with running_gateway(settings, tiny_engine(), RecordingSink()) as url:
        response = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": "Once", "max_tokens": 2, "n": 2},
            headers={"traceparent": "not-a-trace"},  # malformed: a new trace starts
            timeout=30,
        )
        assert response.status_code == 200, response.text
        trace = response.headers["x-ir-trace-id"]
        wait_until(lambda: len(_of(spans, trace)) >= 2, timeout_s=10)
    found = _of(spans, trace)
    first = _one(found, "text_completion tiny-llama", SERVER)
    assert first["parent"] == "" and first["attributes"]["gen_ai.request.choice.count"] == 2
    second = _one(found, "text_completion tiny-llama choice 1", SERVER)
    assert second["parent"] == first["span_id"]
