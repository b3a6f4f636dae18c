"""The versioned telemetry event (one per request), its Kafka record with CloudEvents binary-mode
headers, strict parsing for consumers, and the generated JSON Schema (event-v1.schema.json)."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

log = logging.getLogger(__name__)

# 1.1 prompt_text; 1.2 trust reasons, token confidence; 1.3 end_user, traceparent;
# 1.4 batch_size
SCHEMA_VERSION = "1.4"
SUPPORTED_MAJOR = "1"
CE_TYPE = "io.sparseguard.telemetry.v1"
CE_SOURCE = "sparseguard/gateway"
CONTENT_TYPE = "application/json"
SCHEMA_PATH = Path(__file__).with_name("event-v1.schema.json")
_VERSION_RE = re.compile(r"^(\d+)\.(\d+)$")
# The trust reasons the gateway puts in `trust_reasons`. Consumers count these (the aggregator's
# silence spikes are the events carrying REASON_SILENCE_SPIKE) rather than recompute them, so a
# threshold lives only where the gateway judges.
REASON_SILENCE_SPIKE = "silence-spike"
REASON_GATE_DEGRADED = "gate-degraded"
REASON_MONOTONOUS_INPUT = "monotonous-input"
REASON_LOW_SCORE = "low-score"

Headers = list[tuple[str, bytes]]


class MalformedEventError(ValueError):
    """A record a consumer must dead-letter; `reason` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class EventError(BaseModel):
    type: str
    message: str


class TelemetryEvent(BaseModel):
    """One request's outcome and signals; consumers tolerate unknown fields."""

    model_config = ConfigDict(extra="allow")

    # major.minor: any 1.x validates (minor bumps only add optional fields); other majors are
    # rejected by parse_event before validation.
    schema_version: str = Field(SCHEMA_VERSION, pattern=r"^1\.\d+$")
    trace_id: str = Field(min_length=1, max_length=64)
    time: datetime = Field(description="UTC event time (request start)")
    model: str
    calibration_version: str | None
    level: str = Field(description="dense|conservative|balanced|aggressive")
    mode: Literal["serve", "proxy"]
    api: Literal["openai", "anthropic"]
    status: Literal["ok", "error"]
    finish_reason: str | None = None
    prompt_tokens: int = Field(0, ge=0)
    completion_tokens: int = Field(0, ge=0)
    sparsity_ratio: float | None = None
    sparsity_per_layer: list[float] = []
    gate_confidence: float | None = None
    activation_stability_pct: float | None = None
    silence_rate_per_layer: list[float] = []
    gate_entropy: float | None = None
    input_entropy_bits_per_char: float | None = None
    semantic_drift_kl: float | None = None
    ttft_ms: float | None = None
    total_ms: float | None = None
    queue_ms: float | None = None
    batch_size: float | None = Field(
        None, description="mean sequences per decode step the request ran in (batching)"
    )
    decode_tokens_per_s: float | None = None
    cache_hit_rate: float | None = None
    trust_score: float | None = None
    trust_action: str | None = None
    trust_reasons: list[str] = []
    trust_first_score: float | None = Field(
        None, description="the first answer's trust score, when a trust action regenerated it"
    )
    mean_token_logprob: float | None = None
    mean_token_entropy: float | None = None
    policy_flags: list[str] = []
    hygiene_flags: list[str] = []
    error: EventError | None = None
    prompt_text: str | None = Field(
        None, description="the cleaned prompt, only when the operator keeps prompt text"
    )
    end_user: str | None = Field(
        None, description="sha256 prefix of the caller's end-user id (user, metadata.user_id)"
    )
    traceparent: str | None = Field(
        None, description="the request's W3C trace context (also a Kafka header)"
    )

    @field_validator("time")
    @classmethod
    def _utc(cls, value: datetime) -> datetime:
        if value.tzinfo is None:
            raise ValueError("time must be timezone-aware (send UTC, e.g. 2025-01-01T00:00:00Z)")
        return value.astimezone(UTC)


def partition_key(event: TelemetryEvent) -> bytes:
    """Rolling windows are per model and level: one key's events share a partition, so they
    meet in one aggregator."""
    return f"{event.model}|{event.level}".encode()


def ce_time(event: TelemetryEvent) -> str:
    return event.time.isoformat().replace("+00:00", "Z")


def to_record(event: TelemetryEvent) -> tuple[bytes, bytes, Headers]:
    """(key, value, headers) for Kafka, headers per the CloudEvents Kafka binary binding."""
    headers: Headers = [
        ("ce_specversion", b"1.0"),
        ("ce_id", event.trace_id.encode()),
        ("ce_source", CE_SOURCE.encode()),
        ("ce_type", CE_TYPE.encode()),
        ("ce_time", ce_time(event).encode()),
        ("content-type", CONTENT_TYPE.encode()),
    ]
    if event.traceparent:
        headers.append(("traceparent", event.traceparent.encode()))
    return partition_key(event), event.model_dump_json().encode(), headers


def parse_event(value: bytes, headers: Sequence[tuple[str, bytes]] | None = None) -> TelemetryEvent:
    """Validate one record; raises MalformedEventError (with a reason) for anything a consumer
    must dead-letter: bad JSON, a schema violation, an unknown major version."""
    _check_headers(dict(headers or []))
    data = _load_object(value)
    _check_version(data.get("schema_version", SCHEMA_VERSION))
    try:
        event = TelemetryEvent.model_validate(data)
    except ValidationError as exc:
        raise MalformedEventError(f"schema violation: {summarize_validation(exc)}") from exc
    _check_id(dict(headers or []), event)
    return event


def _load_object(value: bytes) -> dict[str, Any]:
    try:
        data = json.loads(value)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MalformedEventError(f"value is not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise MalformedEventError(f"value must be a JSON object, got {type(data).__name__}")
    return data


def _check_version(version: object) -> None:
    match = _VERSION_RE.match(version) if isinstance(version, str) else None
    if match is None:
        raise MalformedEventError(f"schema_version {version!r} is not 'major.minor'")
    if match.group(1) != SUPPORTED_MAJOR:
        raise MalformedEventError(
            f"unsupported schema_version {version!r}: this consumer reads {SUPPORTED_MAJOR}.x"
        )


def _check_headers(headers: dict[str, bytes]) -> None:
    ce_type = headers.get("ce_type")
    if ce_type is not None and ce_type != CE_TYPE.encode():
        raise MalformedEventError(f"unsupported ce_type {ce_type!r}: expected {CE_TYPE!r}")


def _check_id(headers: dict[str, bytes], event: TelemetryEvent) -> None:
    ce_id = headers.get("ce_id")
    if ce_id is not None and ce_id != event.trace_id.encode():
        raise MalformedEventError(f"ce_id {ce_id!r} does not match trace_id {event.trace_id!r}")


def summarize_validation(exc: ValidationError) -> str:
    """A validation error as one line: each field and what is wrong with it."""
    return "; ".join(
        f"{'.'.join(str(part) for part in err['loc']) or '<root>'}: "
        f"{err['msg'].removeprefix('Value error, ')}"
        for err in exc.errors()
    )


def json_schema_text() -> str:
    """The committed event-v1.schema.json, byte for byte (sorted keys, indent 2, newline)."""
    schema = TelemetryEvent.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = f"urn:{CE_TYPE}"
    return json.dumps(schema, sort_keys=True, indent=2) + "\n"


def write_json_schema(path: Path = SCHEMA_PATH) -> None:
    path.write_text(json_schema_text(), encoding="utf-8")
    log.info("wrote %s", path)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    write_json_schema()
