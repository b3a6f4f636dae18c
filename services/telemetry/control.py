"""Control-topic messages: a new calibration version, published by the worker that made it and
applied by every gateway serving that model's weights. The message carries the whole artefact,
so a gateway needs no shared file system to load it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kafka import KafkaProducer

from services.config import TelemetrySettings
from services.telemetry.topics import ensure_topics, topic_specs
from sparse_engine.calibration.store import Calibration

CALIBRATION_PUBLISHED = "io.sparseguard.calibration.published.v1"
SEND_TIMEOUT_S = 15.0


@dataclass(frozen=True, slots=True)
class CalibrationPublished:
    calibration: Calibration
    reason: str


def encode(cal: Calibration, reason: str) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
    """(key, value, headers): keyed by model weights and level, CloudEvents binary headers."""
    value = {"type": CALIBRATION_PUBLISHED, "reason": reason, "calibration": cal.to_dict()}
    headers = [
        ("ce_specversion", b"1.0"),
        ("ce_id", cal.version.encode()),
        ("ce_source", b"sparseguard/worker"),
        ("ce_type", CALIBRATION_PUBLISHED.encode()),
        ("content-type", b"application/json"),
    ]
    key = f"{cal.weights_sha256}|{cal.level}".encode()
    return key, json.dumps(value).encode(), headers


def decode(value: bytes) -> CalibrationPublished | None:
    """The message, or None for other message types; raises ValueError when malformed."""
    try:
        data: Any = json.loads(value)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"control message is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("control message must be a JSON object")
    if data.get("type") != CALIBRATION_PUBLISHED:
        return None
    artefact = data.get("calibration")
    if not isinstance(artefact, dict) or not artefact.get("version"):
        raise ValueError("calibration message without a versioned calibration")
    try:
        cal = Calibration.from_dict(artefact)
    except TypeError as exc:
        raise ValueError(f"calibration message: {exc}") from None
    return CalibrationPublished(cal, str(data.get("reason", "")))


def publish_calibration(settings: TelemetrySettings, cal: Calibration, reason: str) -> None:
    """Publish on the control topic and wait for the broker to acknowledge it; raises
    KafkaError when it cannot (the task retries)."""
    ensure_topics(settings.bootstrap_servers, topic_specs(settings))
    producer = KafkaProducer(
        bootstrap_servers=settings.bootstrap_servers.split(","),
        acks="all",
        client_id="sparseguard-worker",
    )
    try:
        key, value, headers = encode(cal, reason)
        # Always partition 0, which is what gateways read, even if something auto-created the
        # topic with more partitions (a broker on memory storage after a restart).
        sent = producer.send(
            settings.control_topic, key=key, value=value, headers=headers, partition=0
        )
        sent.get(timeout=SEND_TIMEOUT_S)
    finally:
        producer.close(timeout=5)
