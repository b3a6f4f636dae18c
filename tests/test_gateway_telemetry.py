"""Gateway -> real Kafka-compatible broker (Tansu): every request's event arrives with its
CloudEvents headers, and /readyz follows the broker."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from kafka import KafkaConsumer

from services.config import GatewaySettings, Settings, TelemetrySettings
from services.gateway.app import create_app
from services.shared.serving import serve
from services.telemetry.broker import Broker
from services.telemetry.schema import parse_event
from services.telemetry.topics import ensure_topics, topic_specs
from tests.tiny import tiny_engine


def consume(bootstrap: str, topic: str, want: int, timeout_s: float = 20.0) -> list[object]:
    consumer = KafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        group_id="gateway-telemetry-test",
        session_timeout_ms=6000,
        heartbeat_interval_ms=500,
    )
    records: list[object] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(records) < want and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=500).values():
                records.extend(batch)
    finally:
        consumer.close()
    return records


def test_gateway_events_reach_kafka_and_readyz_follows_broker(
    kafka_broker: Broker, tmp_path: Path
) -> None:
    telemetry = TelemetrySettings(bootstrap_servers=kafka_broker.bootstrap, partitions=2)
    ensure_topics(telemetry.bootstrap_servers, topic_specs(telemetry))
    settings = Settings(home=tmp_path, gateway=GatewaySettings(), telemetry=telemetry)
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "ir_sparse_level": "balanced",
    }
    with serve(create_app(settings, engine=tiny_engine())) as url:
        ok = httpx.post(f"{url}/v1/chat/completions", json=body)
        bad = httpx.post(f"{url}/v1/messages", json={"messages": []})
        traces = {ok.headers["x-ir-trace-id"]}
        records = consume(kafka_broker.bootstrap, telemetry.topic, want=2)
        assert httpx.get(f"{url}/readyz").status_code == 200
        kafka_broker.stop()
        deadline = time.monotonic() + 20
        while httpx.get(f"{url}/readyz").status_code == 200 and time.monotonic() < deadline:
            httpx.post(f"{url}/v1/chat/completions", json=body)  # traffic reveals the outage
            time.sleep(0.5)
        not_ready = httpx.get(f"{url}/readyz")
    assert ok.status_code == 200 and bad.status_code == 400
    events = [parse_event(r.value, r.headers) for r in records]  # type: ignore[attr-defined]
    assert traces <= {e.trace_id for e in events}
    assert {e.status for e in events} == {"ok", "error"}
    headers = dict(records[0].headers)  # type: ignore[attr-defined]
    assert headers["ce_type"] == b"io.sparseguard.telemetry.v1"
    assert records[0].key == b"tiny-llama|balanced" or records[1].key == b"tiny-llama|balanced"  # type: ignore[attr-defined]
    assert not_ready.status_code == 503 and not_ready.json()["broker_reachable"] is False
