"""Replay measured requests on event time through the real fold (services.aggregator.windows)
and the real alert evaluator (alerts.evaluator): hours of traffic in seconds.

Each level gets `rate_per_min` requests a minute, evenly spaced, each one drawn with
replacement from that level's measured pool; inside a scenario's fault period the faulty
level's requests are drawn from the fault's pool instead. Rules are evaluated every `step_s`
of event time, as the aggregator's alert loop does on the wall clock."""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from alerts.definitions import Rule
from alerts.evaluator import EvalState, Transition, evaluate
from alerts.samples import samples_from_windows
from services.aggregator import windows
from services.config import SignalSettings
from services.replay.measure import Measured
from services.telemetry.schema import TelemetryEvent

START = datetime(2026, 1, 1, tzinfo=UTC)
STEP_S = 30.0


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    duration_s: float
    fault: str | None = None
    fault_level: str | None = None
    fault_start_s: float = 0.0
    fault_end_s: float = 0.0

    def faulty(self, level: str, at_s: float) -> bool:
        return (
            self.fault is not None
            and level == self.fault_level
            and self.fault_start_s <= at_s < self.fault_end_s
        )


def events(
    scenario: Scenario,
    pools: Mapping[str, Sequence[Measured]],
    fault_pool: Sequence[Measured],
    rate_per_min: float,
    model_id: str,
    seed: int = 0,
    drift_share: float = 1.0,
) -> Iterator[TelemetryEvent]:
    """The scenario's events in time order, `rate_per_min` per level, each keeping its KL
    drift with probability `drift_share` (the gateway's sample rate), drawn per event: a
    request replayed twice is two requests, and a window's drift samples are as many draws."""
    rng = random.Random(seed)
    interval = 60.0 / rate_per_min
    levels = sorted(pools)
    for i in range(int(scenario.duration_s / interval)):
        for j, level in enumerate(levels):
            at_s = i * interval + j * interval / len(levels)
            pool = fault_pool if scenario.faulty(level, at_s) else pools[level]
            m = rng.choice(pool)
            if rng.random() >= drift_share:
                m = replace(m, stats=replace(m.stats, semantic_drift_kl=None))
            yield to_event(m, START + timedelta(seconds=at_s), model_id, rng)


def to_event(m: Measured, at: datetime, model_id: str, rng: random.Random) -> TelemetryEvent:
    """The event the gateway sends for `m` (services/gateway/events.py), at `at`."""
    s, sig = m.stats, m.stats.signals
    return TelemetryEvent(
        trace_id=f"{rng.getrandbits(64):016x}",
        time=at,
        model=model_id,
        calibration_version=s.calibration_version,
        level=m.level,
        mode="serve",
        api="openai",
        status="ok",
        finish_reason=s.finish_reason,
        prompt_tokens=s.prompt_tokens,
        completion_tokens=s.completion_tokens,
        sparsity_ratio=sig.sparsity_ratio if sig else None,
        sparsity_per_layer=sig.sparsity_per_layer if sig else [],
        gate_confidence=sig.gate_confidence if sig else None,
        activation_stability_pct=sig.activation_stability_pct if sig else None,
        silence_rate_per_layer=sig.silence_rate_per_layer if sig else [],
        gate_entropy=sig.gate_entropy if sig else None,
        input_entropy_bits_per_char=s.input_entropy_bits_per_char,
        semantic_drift_kl=s.semantic_drift_kl,
        ttft_ms=s.time_to_first_token_s * 1000,
        decode_tokens_per_s=s.decode_tokens_per_s,
        cache_hit_rate=s.cache_hit_rate,
        trust_score=m.trust.score,
        trust_action=m.trust.action,
        trust_reasons=list(m.trust.reasons),
    )


@dataclass(frozen=True, slots=True)
class Calibrations:
    """What the aggregator reads from SQL: targets and baselines by calibration version."""

    targets: Mapping[str, float]
    baselines: Mapping[str, Mapping[str, Any] | None]


def replay(
    stream: Iterator[TelemetryEvent],
    rules: Sequence[Rule],
    calibrations: Calibrations,
    signals: SignalSettings,
    duration_s: float,
    step_s: float = STEP_S,
) -> list[Transition]:
    """Every alert transition of the stream, evaluated each `step_s` of event time."""
    state = windows.new_state(
        windows.FoldConfig(gate_band=signals.gate_band, late_band=signals.late_band)
    )
    alerts = EvalState()
    found: list[Transition] = []
    pending = next(stream, None)
    ticks = int(duration_s / step_s)
    for tick in range(1, ticks + 1):
        now = START + timedelta(seconds=tick * step_s)
        batch = []
        while pending is not None and pending.time < now:
            batch.append(pending)
            pending = next(stream, None)
        windows.apply(state, batch)
        snap = windows.snapshot(state, now, calibrations.targets, calibrations.baselines, signals)
        alerts, transitions = evaluate(
            alerts, rules, samples_from_windows(snap), now, repeat_interval_s=3600
        )
        found.extend(t for t in transitions if t.state != "pending")
    return found


def seconds(at: datetime) -> float:
    return (at - START).total_seconds()
