"""Kafka records to events and SQL rows; malformed records to the dead-letter topic."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from services.telemetry.schema import MalformedEventError, TelemetryEvent, parse_event


class KafkaRecord(Protocol):
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    headers: list[tuple[str, bytes]]


@dataclass(frozen=True, slots=True)
class Parsed:
    event: TelemetryEvent
    partition: int
    offset: int


@dataclass(frozen=True, slots=True)
class Rejected:
    record: KafkaRecord
    reason: str


def parse_records(records: list[KafkaRecord]) -> tuple[list[Parsed], list[Rejected]]:
    parsed, rejected = [], []
    for record in records:
        try:
            event = parse_event(record.value, record.headers)
        except MalformedEventError as exc:
            rejected.append(Rejected(record, str(exc)))
        else:
            parsed.append(Parsed(event, record.partition, record.offset))
    return parsed, rejected


def summary_row(item: Parsed) -> dict[str, Any]:
    """The request_summaries row of one event (the whole event is kept as JSON too)."""
    e = item.event
    return {
        "trace_id": e.trace_id,
        "time": e.time,
        "model": e.model,
        "level": e.level,
        "mode": e.mode,
        "api": e.api,
        "status": e.status,
        "calibration_version": e.calibration_version,
        "partition": item.partition,
        "offset": item.offset,
        "sparsity_ratio": e.sparsity_ratio,
        "gate_confidence": e.gate_confidence,
        "activation_stability_pct": e.activation_stability_pct,
        "semantic_drift_kl": e.semantic_drift_kl,
        "ttft_ms": e.ttft_ms,
        "total_ms": e.total_ms,
        "cache_hit_rate": e.cache_hit_rate,
        "trust_score": e.trust_score,
        "trust_action": e.trust_action,
        "prompt_tokens": e.prompt_tokens,
        "completion_tokens": e.completion_tokens,
        "error_type": e.error.type if e.error else None,
        "event": e.model_dump(mode="json"),
    }


def dead_letter_headers(rejected: Rejected) -> list[tuple[str, bytes]]:
    record = rejected.record
    extra = [
        ("dlq_reason", rejected.reason.encode()[:1000]),
        ("dlq_source", f"{record.topic}/{record.partition}/{record.offset}".encode()),
    ]
    return list(record.headers or []) + extra
