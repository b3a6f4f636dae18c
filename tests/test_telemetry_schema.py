"""Unit tests of the telemetry event contract: record round trip, CloudEvents headers,
tolerance of unknown fields, rejection reasons, and the committed JSON Schema."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone

import pytest

from services.telemetry.schema import (
    CE_TYPE,
    SCHEMA_PATH,
    EventError,
    MalformedEventError,
    TelemetryEvent,
    json_schema_text,
    parse_event,
    partition_key,
    to_record,
)


def make_event(**overrides: object) -> TelemetryEvent:
    fields: dict[str, object] = {
        "trace_id": "trace-0001",
        "time": datetime(2025, 3, 1, 12, 30, 15, 250000, tzinfo=UTC),
        "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "calibration_version": "cal-7",
        "level": "balanced",
        "mode": "serve",
        "api": "openai",
        "status": "ok",
        "finish_reason": "stop",
        "prompt_tokens": 12,
        "completion_tokens": 30,
        "sparsity_ratio": 0.41,
        "sparsity_per_layer": [0.4, 0.42],
        "silence_rate_per_layer": [0.01, 0.02],
        "ttft_ms": 85.5,
        "policy_flags": ["pii"],
    }
    fields.update(overrides)
    return TelemetryEvent.model_validate(fields)


def test_record_round_trip() -> None:
    event = make_event(error=EventError(type="timeout", message="upstream took too long"))
    key, value, headers = to_record(event)
    assert key == b"HuggingFaceTB/SmolLM2-135M-Instruct|balanced"
    assert key == partition_key(event)
    assert parse_event(value, headers) == event


def test_cloudevents_headers() -> None:
    _, _, headers = to_record(make_event())
    assert dict(headers) == {
        "ce_specversion": b"1.0",
        "ce_id": b"trace-0001",
        "ce_source": b"sparseguard/gateway",
        "ce_type": CE_TYPE.encode(),
        "ce_time": b"2025-03-01T12:30:15.250000Z",
        "content-type": b"application/json",
    }


def test_time_is_normalised_to_utc() -> None:
    local = datetime(2025, 3, 1, 14, 30, tzinfo=timezone(timedelta(hours=2)))
    assert make_event(time=local).time == datetime(2025, 3, 1, 12, 30, tzinfo=UTC)


def test_unknown_fields_are_tolerated_and_kept() -> None:
    _, value, headers = to_record(make_event())
    data = json.loads(value) | {"schema_version": "1.4", "gpu_watts": 212.5}
    event = parse_event(json.dumps(data).encode(), headers)
    assert event.schema_version == "1.4"
    assert event.model_extra == {"gpu_watts": 212.5}


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (b"{not json", "value is not JSON"),
        (b"\xff\xfe", "value is not JSON"),
        (b"[1, 2]", "must be a JSON object, got list"),
    ],
)
def test_bad_json_is_rejected(value: bytes, reason: str) -> None:
    with pytest.raises(MalformedEventError, match=reason) as info:
        parse_event(value)
    assert reason in info.value.reason


def test_missing_field_is_rejected_with_its_name() -> None:
    data = make_event().model_dump(mode="json")
    del data["model"]
    with pytest.raises(MalformedEventError, match=r"schema violation: model: Field required"):
        parse_event(json.dumps(data).encode())


def test_wrong_type_is_rejected() -> None:
    data = make_event().model_dump(mode="json") | {"prompt_tokens": -1, "mode": "batch"}
    with pytest.raises(MalformedEventError, match="prompt_tokens") as info:
        parse_event(json.dumps(data).encode())
    assert "mode" in info.value.reason


def test_naive_time_is_rejected() -> None:
    data = make_event().model_dump(mode="json") | {"time": "2025-03-01T12:30:15"}
    with pytest.raises(MalformedEventError, match="timezone-aware"):
        parse_event(json.dumps(data).encode())


@pytest.mark.parametrize("version", ["2.0", "0.9", "1", 1.0])
def test_unknown_major_version_is_rejected(version: object) -> None:
    data = make_event().model_dump(mode="json") | {"schema_version": version}
    with pytest.raises(MalformedEventError, match="schema_version"):
        parse_event(json.dumps(data).encode())


def test_major_2_reason_names_the_version() -> None:
    data = make_event().model_dump(mode="json") | {"schema_version": "2.0"}
    with pytest.raises(MalformedEventError) as info:
        parse_event(json.dumps(data).encode())
    assert info.value.reason == "unsupported schema_version '2.0': this consumer reads 1.x"


def test_foreign_ce_type_is_rejected() -> None:
    _, value, headers = to_record(make_event())
    headers = [(n, b"io.sparseguard.telemetry.v2" if n == "ce_type" else v) for n, v in headers]
    with pytest.raises(MalformedEventError, match="unsupported ce_type"):
        parse_event(value, headers)


def test_ce_id_must_match_trace_id() -> None:
    _, value, headers = to_record(make_event())
    headers = [(n, b"other" if n == "ce_id" else v) for n, v in headers]
    with pytest.raises(MalformedEventError, match="does not match trace_id"):
        parse_event(value, headers)


def test_schema_file_is_up_to_date() -> None:
    assert SCHEMA_PATH.read_text(encoding="utf-8") == json_schema_text(), (
        "event-v1.schema.json is stale: run `python -m services.telemetry.schema`"
    )


def test_schema_documents_the_contract() -> None:
    schema = json.loads(json_schema_text())
    assert schema["additionalProperties"] is True
    assert schema["properties"]["schema_version"]["pattern"] == r"^1\.\d+$"
    assert set(schema["required"]) >= {"trace_id", "time", "model", "level", "status"}
