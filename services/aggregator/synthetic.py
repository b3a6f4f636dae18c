"""Synthetic telemetry for the fold benchmark and tests, and the pure fold throughput."""

from __future__ import annotations

import random
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from services.aggregator.windows import apply, new_state
from services.telemetry.schema import REASON_SILENCE_SPIKE, TelemetryEvent

SPIKE_SHARE = 0.01  # requests the (imagined) gateway judged a silence spike


def synthetic_events(num_events: int, seed: int = 0) -> list[TelemetryEvent]:
    """Plausible events for benchmarks and tests: 4 keys, one every 50 ms, 30 layers, 2% errors."""
    rng = random.Random(seed)
    start = datetime(2025, 1, 1, tzinfo=UTC)
    return [
        _synthetic_event(rng, i, start + timedelta(milliseconds=50 * i)) for i in range(num_events)
    ]


def _synthetic_event(rng: random.Random, i: int, at: datetime) -> TelemetryEvent:
    ok = rng.random() > 0.02
    common: dict[str, Any] = {
        "trace_id": f"synthetic-{i}",
        "time": at,
        "model": "synthetic-model",
        "calibration_version": "cal-1",
        "level": ("conservative", "balanced", "aggressive", "dense")[i % 4],
        "mode": "serve",
        "api": "openai",
        "status": "ok" if ok else "error",
    }
    if not ok:
        return TelemetryEvent(**common)
    return TelemetryEvent(
        **common,
        sparsity_ratio=rng.uniform(0.4, 0.7),
        gate_confidence=rng.uniform(0.7, 0.95),
        activation_stability_pct=rng.uniform(0, 8),
        gate_entropy=rng.uniform(0.85, 0.97),
        silence_rate_per_layer=[rng.random() for _ in range(30)],
        semantic_drift_kl=rng.uniform(0, 1) if rng.random() < 0.1 else None,
        ttft_ms=rng.lognormvariate(4, 1),
        total_ms=rng.lognormvariate(7, 1),
        cache_hit_rate=rng.random(),
        trust_action=rng.choice(("none", "none", "flag")),
        trust_reasons=[REASON_SILENCE_SPIKE] if rng.random() < SPIKE_SHARE else [],
    )


def fold_throughput(num_events: int) -> float:
    """Events per second of `apply` over `num_events` synthetic events (built before timing)."""
    if num_events < 1:
        raise ValueError("num_events must be at least 1")
    events = synthetic_events(num_events)
    state = new_state()
    started = time.perf_counter()
    apply(state, events)
    return num_events / (time.perf_counter() - started)
