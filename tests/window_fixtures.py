"""Events and helpers shared by the rolling-window fold tests."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from services.aggregator.windows import (
    FoldConfig,
    Key,
    State,
    apply,
    new_state,
)
from services.telemetry.schema import TelemetryEvent

BASE = datetime(2025, 3, 1, tzinfo=UTC)  # a multiple of every bucket size
KEY: Key = ("m1", "balanced")
KEYS: list[Key] = [KEY, ("m1", "aggressive"), ("m2", "balanced")]
SIGNALS = (
    "sparsity_ratio",
    "gate_confidence",
    "activation_stability_pct",
    "semantic_drift_kl",
    "cache_hit_rate",
    "gate_entropy",
)
SUMMARY_MEANS = (
    "sparsity_mean",
    "gate_confidence_mean",
    "activation_stability_mean",
    "drift_kl_mean",
    "cache_hit_rate_mean",
    "gate_entropy_mean",
)
BIN_RATIO = 10 ** (1 / 20)


def make_event(at: datetime = BASE, **overrides: Any) -> TelemetryEvent:
    fields: dict[str, Any] = {
        "trace_id": "t",
        "time": at,
        "model": KEY[0],
        "calibration_version": "cal-1",
        "level": KEY[1],
        "mode": "serve",
        "api": "openai",
        "status": "ok",
    }
    return TelemetryEvent(**(fields | overrides))


def fold(events: Sequence[TelemetryEvent], config: FoldConfig | None = None) -> State:
    return apply(new_state(config), events)


def secs(seconds: float) -> datetime:
    return BASE + timedelta(seconds=seconds)
