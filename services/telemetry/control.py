"""Control-topic messages, each a versioned JSON object whose `type` names its kind:

- `io.sparseguard.calibration.published.v1`: a new calibration version, published by the
  worker that made it and applied by every gateway serving that model's weights;
- `io.sparseguard.trust-model.published.v1`: a new trust model, published by the worker that
  fit it and installed by every gateway serving that model.

A message carries the whole artefact, so a gateway needs no shared file system to load it. A
reader ignores types it does not know, so old gateways skip trust models and new ones still
read the calibration messages they always did."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kafka import KafkaProducer

from services.config import TelemetrySettings
from services.telemetry.topics import ensure_topics, topic_specs
from sparse_engine.calibration.store import Calibration
from sparse_engine.trust.model import TrustModel

CALIBRATION_PUBLISHED = "io.sparseguard.calibration.published.v1"
TRUST_MODEL_PUBLISHED = "io.sparseguard.trust-model.published.v1"
SEND_TIMEOUT_S = 15.0
Record = tuple[bytes, bytes, list[tuple[str, bytes]]]  # key, value, headers


@dataclass(frozen=True, slots=True)
class CalibrationPublished:
    calibration: Calibration
    reason: str


@dataclass(frozen=True, slots=True)
class TrustModelPublished:
    model: TrustModel
    reason: str


ControlMessage = CalibrationPublished | TrustModelPublished


def encode(cal: Calibration, reason: str) -> Record:
    """A calibration, keyed by model weights and level, with CloudEvents binary headers."""
    value = {"type": CALIBRATION_PUBLISHED, "reason": reason, "calibration": cal.to_dict()}
    key = f"{cal.weights_sha256}|{cal.level}"
    return _record(CALIBRATION_PUBLISHED, key, cal.version, value)


def encode_trust_model(model: TrustModel, reason: str) -> Record:
    """A trust model, keyed by model id and the level it was fit at."""
    if not model.version:
        raise ValueError("save the trust model (TrustStore.save) before publishing it")
    value = {"type": TRUST_MODEL_PUBLISHED, "reason": reason, "trust_model": model.to_dict()}
    return _record(
        TRUST_MODEL_PUBLISHED, f"{model.model_id}|trust|{model.level}", model.version, value
    )


def _record(kind: str, key: str, version: str, value: dict[str, Any]) -> Record:
    headers = [
        ("ce_specversion", b"1.0"),
        ("ce_id", version.encode()),
        ("ce_source", b"sparseguard/worker"),
        ("ce_type", kind.encode()),
        ("content-type", b"application/json"),
    ]
    return key.encode(), json.dumps(value).encode(), headers


def decode(value: bytes) -> ControlMessage | None:
    """The message, or None for types this version does not know; raises ValueError when
    malformed."""
    try:
        data: Any = json.loads(value)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"control message is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("control message must be a JSON object")
    reason = str(data.get("reason", ""))
    if data.get("type") == CALIBRATION_PUBLISHED:
        return CalibrationPublished(_calibration(data.get("calibration")), reason)
    if data.get("type") == TRUST_MODEL_PUBLISHED:
        return TrustModelPublished(_trust_model(data.get("trust_model")), reason)
    return None


def _calibration(artefact: Any) -> Calibration:
    if not isinstance(artefact, dict) or not artefact.get("version"):
        raise ValueError("calibration message without a versioned calibration")
    try:
        return Calibration.from_dict(artefact)
    except TypeError as exc:
        raise ValueError(f"calibration message: {exc}") from None


def _trust_model(artefact: Any) -> TrustModel:
    if not isinstance(artefact, dict) or not artefact.get("version"):
        raise ValueError("trust-model message without a versioned trust model")
    try:
        return TrustModel.from_dict(artefact)  # ValueError for a model of other features
    except TypeError as exc:
        raise ValueError(f"trust-model message: {exc}") from None


def publish_calibration(settings: TelemetrySettings, cal: Calibration, reason: str) -> None:
    """Publish on the control topic and wait for the broker to acknowledge it; raises
    KafkaError when it cannot (the task retries)."""
    _publish(settings, encode(cal, reason))


def publish_trust_model(settings: TelemetrySettings, model: TrustModel, reason: str) -> None:
    """Publish a saved trust model like a calibration (acknowledged, or KafkaError)."""
    _publish(settings, encode_trust_model(model, reason))


def _publish(settings: TelemetrySettings, record: Record) -> None:
    ensure_topics(settings.bootstrap_servers, topic_specs(settings))
    producer = KafkaProducer(
        bootstrap_servers=settings.bootstrap_servers.split(","),
        acks="all",
        client_id="sparseguard-worker",
    )
    try:
        key, value, headers = record
        # Always partition 0, which is what gateways read, even if something auto-created the
        # topic with more partitions (a broker on memory storage after a restart).
        sent = producer.send(
            settings.control_topic, key=key, value=value, headers=headers, partition=0
        )
        sent.get(timeout=SEND_TIMEOUT_S)
    finally:
        producer.close(timeout=5)
