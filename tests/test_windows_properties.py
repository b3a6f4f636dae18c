"""Property tests of the fold (Hypothesis): a brute-force reference over the raw events, order
independence within lateness and histogram quantile bounds."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.aggregator.histograms import LATENCY_EDGES_MS, Histogram
from services.aggregator.summary import WindowSummary
from services.aggregator.windows import (
    FoldConfig,
    Key,
    snapshot,
)
from services.telemetry.schema import (
    REASON_GATE_DEGRADED,
    REASON_LOW_SCORE,
    REASON_SILENCE_SPIKE,
    TelemetryEvent,
)
from tests.window_fixtures import (
    BASE,
    BIN_RATIO,
    KEYS,
    SIGNALS,
    SUMMARY_MEANS,
    fold,
    make_event,
    secs,
)

_UNIT = st.none() | st.floats(0, 1)
_LATENCY = st.none() | st.floats(0.01, 200_000)
EVENT_FIELDS = st.fixed_dictionaries(
    {
        "status": st.sampled_from(["ok", "ok", "ok", "error"]),
        "calibration_version": st.sampled_from(["cal-1", "cal-2", None]),
        "sparsity_ratio": _UNIT,
        "gate_confidence": _UNIT,
        "activation_stability_pct": st.none() | st.floats(0, 50),
        "semantic_drift_kl": _UNIT,
        "cache_hit_rate": _UNIT,
        "gate_entropy": _UNIT,
        "silence_rate_per_layer": st.lists(st.floats(0, 1), max_size=5),
        "trust_action": st.sampled_from([None, "none", "flag", "fallback"]),
        "trust_reasons": st.lists(
            st.sampled_from([REASON_SILENCE_SPIKE, REASON_GATE_DEGRADED, REASON_LOW_SCORE]),
            max_size=2,
            unique=True,
        ),
        "ttft_ms": _LATENCY,
        "total_ms": _LATENCY,
    }
)


@st.composite
def events_strategy(draw: st.DrawFn, max_offset_s: int | None = None) -> list[TelemetryEvent]:
    """Up to 40 events over 3 keys, spread over 10 min, 2 h or 2 days (or `max_offset_s`)."""
    span_ms = 1000 * (max_offset_s or draw(st.sampled_from([600, 7200, 2 * 86400])))
    # Times on a 10 s or 5 min grid make events share ring slots, so recycling is exercised.
    step_ms = draw(st.sampled_from([1, 10_000, 300_000]))
    events = []
    drawn = st.tuples(st.integers(0, 2 * 86400 * 1000), st.sampled_from(KEYS), EVENT_FIELDS)
    for i, (raw, (model, level), fields) in enumerate(draw(st.lists(drawn, max_size=40))):
        at = BASE + timedelta(milliseconds=step_ms * (raw % (span_ms // step_ms + 1)))
        events.append(make_event(at, trace_id=f"t{i}", model=model, level=level, **fields))
    return events


def accepted_by_watermark(
    events: Sequence[TelemetryEvent], lateness_s: float
) -> list[TelemetryEvent]:
    watermarks: dict[Key, float] = {}
    kept = []
    for event in events:
        key, at = (event.model, event.level), event.time.timestamp()
        if at >= watermarks.get(key, -math.inf) - lateness_s:
            watermarks[key] = max(watermarks.get(key, -math.inf), at)
            kept.append(event)
    return kept


def in_window(event: TelemetryEvent, window: str, config: FoldConfig, now: datetime) -> bool:
    size = config.bucket_s[window]
    last = math.floor(now.timestamp() / size)
    index = math.floor(event.time.timestamp() / size)
    return last - config.ring_size(window) < index <= last


def mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def nearest_rank(values: list[float], p: int) -> float:
    ordered = sorted(values)
    return ordered[-(-p * len(ordered) // 100) - 1]


def check_quantiles(summary_q: Any, values: list[float]) -> None:
    if not values:
        assert summary_q is None
        return
    assert summary_q.count == len(values) and summary_q.max == max(values)
    for p, got in zip((50, 90, 99), (summary_q.p50, summary_q.p90, summary_q.p99), strict=True):
        exact = nearest_rank(values, p)
        if exact > LATENCY_EDGES_MS[-1]:  # the overflow bin reports the largest value seen
            assert got == max(values)
        else:
            assert exact <= got <= max(exact * BIN_RATIO, 1.0) * (1 + 1e-12)


def check_against_brute_force(
    got: WindowSummary, raw: list[TelemetryEvent], config: FoldConfig
) -> None:
    ok = [e for e in raw if e.status == "ok"]
    assert (got.requests, got.errors) == (len(raw), len(raw) - len(ok))
    assert got.error_rate == pytest.approx((len(raw) - len(ok)) / len(raw) if raw else 0.0)
    for field, signal in zip(SUMMARY_MEANS, SIGNALS, strict=True):
        assert getattr(got, field) == pytest.approx(mean([getattr(e, signal) for e in ok]))
    gates = [e.gate_confidence for e in ok if e.gate_confidence is not None]
    low, high = config.gate_band
    outside = mean([float(not low <= g <= high) for g in gates])
    assert got.gate_outside_band_share == pytest.approx(outside)
    assert got.drift_samples == sum(e.semantic_drift_kl is not None for e in ok)
    layers = max((len(e.silence_rate_per_layer) for e in ok), default=0)
    per_layer = [
        mean([e.silence_rate_per_layer[i] for e in ok if i < len(e.silence_rate_per_layer)])
        for i in range(layers)
    ]
    assert got.silence_rate_per_layer == pytest.approx(per_layer)
    assert got.silence_spikes == sum(REASON_SILENCE_SPIKE in e.trust_reasons for e in ok)
    actions = [e.trust_action for e in ok if e.trust_action not in (None, "none")]
    assert got.trust_actions == {a: actions.count(a) for a in set(actions) if a is not None}
    check_quantiles(got.ttft_ms, [e.ttft_ms for e in ok if e.ttft_ms is not None])
    check_quantiles(got.latency_ms, [e.total_ms for e in ok if e.total_ms is not None])


@settings(max_examples=150, deadline=None)
@given(
    events=events_strategy(),
    lateness_s=st.sampled_from([0.0, 120.0, 1e9]),
    later_ms=st.integers(0, 2 * 86400 * 1000),
)
def test_bucketed_summary_equals_brute_force(
    events: list[TelemetryEvent], lateness_s: float, later_ms: int
) -> None:
    config = FoldConfig(lateness_s=lateness_s)
    state = fold(events, config)
    accepted = accepted_by_watermark(events, lateness_s)
    assert (state.events_applied, state.late_dropped) == (
        len(accepted),
        len(events) - len(accepted),
    )
    latest = max((e.time for e in events), default=BASE)
    now = latest + timedelta(milliseconds=later_ms)
    for key, windows in snapshot(state, now).items():
        mine = [e for e in accepted if (e.model, e.level) == key]
        versions = [
            (e.time, e.calibration_version)
            for e in mine
            if e.status == "ok" and e.calibration_version
        ]
        expected_version = max(versions)[1] if versions else None
        for name, summary in windows.items():
            assert summary.calibration_version == expected_version
            check_against_brute_force(
                summary, [e for e in mine if in_window(e, name, config, now)], config
            )


# --- order independence ------------------------------------------------------------


def assert_close(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b)
        for k in a:
            assert_close(a[k], b[k])
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_close(x, y)
    elif isinstance(a, float):
        assert b == pytest.approx(a, rel=1e-9, abs=1e-12)
    else:
        assert a == b


def as_dicts(snap: dict[Key, dict[str, WindowSummary]]) -> dict[str, Any]:
    return {"|".join(k): {w: s.to_dict() for w, s in v.items()} for k, v in snap.items()}


@settings(max_examples=100, deadline=None)
@given(events=events_strategy(max_offset_s=120), seed=st.integers(0, 2**32 - 1))
def test_shuffled_input_within_lateness_gives_the_same_snapshot(
    events: list[TelemetryEvent], seed: int
) -> None:
    shuffled = list(events)
    random.Random(seed).shuffle(shuffled)
    now = secs(125)
    first, second = fold(events), fold(shuffled)
    assert first.late_dropped == second.late_dropped == 0
    assert_close(as_dicts(snapshot(first, now)), as_dicts(snapshot(second, now)))


@given(values=st.lists(st.floats(0, 500_000), min_size=1, max_size=200), split=st.integers(0, 200))
def test_histogram_quantiles_bracket_the_exact_nearest_rank(
    values: list[float], split: int
) -> None:
    left, right = Histogram(), Histogram()
    for i, value in enumerate(values):
        (left if i < split else right).add(value)
    left.merge(right)
    check_quantiles(left.quantiles(), values)
