"""The pure rolling-window fold: hand-made known answers for every summary field, a brute-force
reference over the raw events (Hypothesis), order independence, lateness, bounded memory,
merge of partial states, and the latency histogram quantile bounds."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.aggregator.histograms import LATENCY_EDGES_MS, NUM_BINS, Histogram
from services.aggregator.windows import (
    WINDOWS,
    FoldConfig,
    Key,
    State,
    WindowSummary,
    apply,
    drop_keys,
    fold_throughput,
    merge,
    new_state,
    snapshot,
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
)
SUMMARY_MEANS = (
    "sparsity_mean",
    "gate_confidence_mean",
    "activation_stability_mean",
    "drift_kl_mean",
    "cache_hit_rate_mean",
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


# --- known answers -------------------------------------------------------------------------


def hand_made_events() -> list[TelemetryEvent]:
    spike = {"silence_rate_per_layer": [0.1, 0.9, 0.9, 0.9], "trust_action": "flag"}
    return [
        make_event(
            secs(1),
            sparsity_ratio=0.5,
            gate_confidence=0.80,
            semantic_drift_kl=0.4,
            activation_stability_pct=2.0,
            ttft_ms=10.0,
            total_ms=100.0,
            cache_hit_rate=0.9,
            **spike,
        ),
        make_event(
            secs(15),
            sparsity_ratio=0.7,
            gate_confidence=0.95,
            activation_stability_pct=4.0,
            silence_rate_per_layer=[0.3, 0.1, 0.1, 0.1],
            ttft_ms=20.0,
            total_ms=200.0,
            trust_action="none",
            calibration_version="cal-2",
        ),
        make_event(secs(30), status="error", calibration_version="cal-3"),
        make_event(
            secs(40),
            gate_confidence=0.70,
            silence_rate_per_layer=[0.5, 0.8],
            ttft_ms=1000.0,
            total_ms=5000.0,
            trust_action="fallback",
            calibration_version="cal-2",
        ),
    ]


def test_hand_made_events_give_known_answers_in_every_window() -> None:
    state = fold(hand_made_events())
    windows = snapshot(state, secs(60), targets={"cal-2": 0.6})[KEY]
    assert set(windows) == set(WINDOWS)
    for name, summary in windows.items():
        assert summary.window == name
        assert summary.requests == 4 and summary.errors == 1 and summary.error_rate == 0.25
        assert summary.sparsity_mean == pytest.approx(0.6)
        assert summary.sparsity_target == 0.6
        assert summary.calibration_version == "cal-2"  # the error event's cal-3 is not counted
        assert summary.gate_confidence_mean == pytest.approx((0.80 + 0.95 + 0.70) / 3)
        assert summary.gate_outside_band_share == pytest.approx(2 / 3)
        assert summary.activation_stability_mean == pytest.approx(3.0)
        assert summary.drift_kl_mean == pytest.approx(0.4) and summary.drift_samples == 1
        assert summary.silence_rate_per_layer == pytest.approx([0.3, 0.6, 0.5, 0.5])
        assert summary.silence_spikes == 1
        assert summary.trust_actions == {"flag": 1, "fallback": 1}
        assert summary.cache_hit_rate_mean == pytest.approx(0.9)
        assert summary.ttft_ms is not None and summary.latency_ms is not None
        ttft, latency = summary.ttft_ms, summary.latency_ms
        assert (ttft.count, ttft.max) == (3, 1000.0)
        assert ttft.p50 == pytest.approx(10 ** (27 / 20))  # 20 ms -> bin (19.95, 22.39]
        assert ttft.p90 == ttft.p99 == pytest.approx(1000.0)  # exactly on an edge
        assert latency.p50 == pytest.approx(10 ** (47 / 20))  # 200 ms -> bin (199.5, 223.9]
        assert latency.p90 == latency.p99 == 5000.0  # bin edge 5011.9 capped at the max seen


def test_window_bounds_follow_the_bucket_holding_now() -> None:
    windows = snapshot(fold(hand_made_events()), secs(65))[KEY]
    assert (windows["5m"].start, windows["5m"].end) == (secs(-230), secs(70))
    assert (windows["1h"].start, windows["1h"].end) == (secs(-3480), secs(120))
    assert (windows["24h"].start, windows["24h"].end) == (secs(-85500), secs(900))
    assert windows["5m"].sparsity_target is None  # no targets given


def test_to_dict_is_json_ready() -> None:
    summary = snapshot(fold(hand_made_events()), secs(60))[KEY]["5m"]
    data = json.loads(json.dumps(summary.to_dict()))
    assert data["start"] == "2025-02-28T23:56:10Z" and data["end"] == "2025-03-01T00:01:10Z"
    assert data["latency_ms"]["count"] == 3 and data["trust_actions"] == {"flag": 1, "fallback": 1}
    assert set(data) == {f for f in WindowSummary.__dataclass_fields__}


def test_error_events_count_in_requests_and_errors_only() -> None:
    failed = make_event(
        status="error",
        total_ms=50.0,
        sparsity_ratio=0.3,
        trust_action="flag",
        silence_rate_per_layer=[0.99, 0.99, 0.99],
    )
    summary = snapshot(fold([make_event(status="error"), failed]), secs(1))[KEY]["5m"]
    assert (summary.requests, summary.errors, summary.error_rate) == (2, 2, 1.0)
    assert all(getattr(summary, name) is None for name in SUMMARY_MEANS)
    assert summary.gate_outside_band_share is None and summary.sparsity_target is None
    assert summary.ttft_ms is None and summary.latency_ms is None
    assert summary.calibration_version is None
    assert (summary.drift_samples, summary.silence_spikes) == (0, 0)
    assert summary.silence_rate_per_layer == [] and summary.trust_actions == {}


def test_non_finite_signals_are_treated_as_missing() -> None:
    events = [
        make_event(sparsity_ratio=math.nan, total_ms=math.inf),
        make_event(sparsity_ratio=0.4),
    ]
    summary = snapshot(fold(events), secs(1))[KEY]["5m"]
    assert summary.sparsity_mean == pytest.approx(0.4) and summary.latency_ms is None


def test_empty_window_after_the_traffic_has_passed() -> None:
    windows = snapshot(fold(hand_made_events()), secs(3600))[KEY]
    assert windows["5m"].requests == 0 and windows["5m"].error_rate == 0.0
    assert windows["5m"].sparsity_mean is None and windows["5m"].ttft_ms is None
    assert windows["24h"].requests == 4


# --- lateness and memory -------------------------------------------------------------------


def test_events_beyond_lateness_are_dropped_and_counted() -> None:
    state = fold([make_event(secs(1000)), make_event(secs(879.9)), make_event(secs(880))])
    assert (state.events_applied, state.late_dropped) == (2, 1)
    assert state.watermark(KEY) == secs(1000)
    assert state.watermark(("other", "model")) is None


def test_a_late_event_within_lateness_lands_in_its_own_bucket() -> None:
    state = fold(
        [make_event(secs(1000), sparsity_ratio=0.9), make_event(secs(905), sparsity_ratio=0.1)]
    )
    # at now = 1200 the 5m window starts at 910: the late event's bucket [900, 910) just left it
    assert snapshot(state, secs(1200))[KEY]["5m"].sparsity_mean == pytest.approx(0.9)
    assert snapshot(state, secs(1199.9))[KEY]["5m"].requests == 2
    assert snapshot(state, secs(1005))[KEY]["5m"].sparsity_mean == pytest.approx(0.5)


def test_an_event_older_than_a_ring_skips_that_window_only() -> None:
    config = FoldConfig(lateness_s=1e9)
    state = fold([make_event(secs(400)), make_event(secs(100))], config)  # same 5m ring slot
    windows = snapshot(state, secs(400))[KEY]
    assert (windows["5m"].requests, windows["1h"].requests, windows["24h"].requests) == (1, 2, 2)
    assert state.events_applied == 2


def test_memory_per_key_is_bounded_by_the_ring_sizes() -> None:
    config = FoldConfig()
    sizes = {w: config.ring_size(w) for w in WINDOWS}
    assert sizes == {"5m": 30, "1h": 60, "24h": 96}
    template = make_event(silence_rate_per_layer=[0.5] * 4, trust_action="flag", ttft_ms=5.0)
    state = new_state(config)
    rng = random.Random(7)
    step = 3 * 86400 / 100_000  # 100k events over three days
    for chunk in range(100):
        events = [
            template.model_copy(
                update={
                    "time": secs((chunk * 1000 + i) * step),
                    "level": rng.choice(("a", "b")),
                    "total_ms": rng.lognormvariate(6, 2),
                }
            )
            for i in range(1000)
        ]
        apply(state, events)
        for entry in state.keys.values():
            assert {w: len(r.slots) for w, r in entry.rings.items()} == sizes
            assert all(entry.num_buckets()[w] <= sizes[w] for w in sizes)
    assert state.events_applied == 100_000 and state.late_dropped == 0
    for entry in state.keys.values():
        assert entry.num_buckets() == sizes
        buckets = [b for r in entry.rings.values() for b in r.slots if b is not None]
        assert all(len(b.silence_sums) == 4 and len(b.latency.counts) <= NUM_BINS for b in buckets)


# --- brute force reference (Hypothesis) ------------------------------------------------------


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
        "silence_rate_per_layer": st.lists(st.floats(0, 1), max_size=5),
        "trust_action": st.sampled_from([None, "none", "flag", "fallback"]),
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
    bands = [e.silence_rate_per_layer[-config.late_layers :] for e in ok]
    assert got.silence_spikes == sum(
        bool(b) and sum(b) / len(b) > config.spike_threshold for b in bands
    )
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


# --- order independence and merge ------------------------------------------------------------


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


@settings(max_examples=100, deadline=None)
@given(events=events_strategy(), picks=st.lists(st.booleans(), min_size=40, max_size=40))
def test_merge_of_partial_states_equals_one_fold(
    events: list[TelemetryEvent], picks: list[bool]
) -> None:
    config = FoldConfig(lateness_s=1e9)  # no event is late against the other member's watermark
    part_a = [e for e, pick in zip(events, picks, strict=False) if pick]
    part_b = [e for e, pick in zip(events, picks, strict=False) if not pick]
    a, b = fold(part_a, config), fold(part_b, config)
    now = max((e.time for e in events), default=BASE) + timedelta(seconds=1)
    before = as_dicts(snapshot(a, now))
    merged = merge(a, b)
    whole = fold(events, config)
    assert (merged.events_applied, merged.late_dropped) == (whole.events_applied, 0)
    assert_close(as_dicts(snapshot(merged, now)), as_dicts(snapshot(whole, now)))
    assert_close(as_dicts(snapshot(a, now)), before)  # inputs untouched
    for key in whole.keys:
        assert merged.watermark(key) == whole.watermark(key)


def test_merge_needs_the_same_config() -> None:
    with pytest.raises(ValueError, match="same FoldConfig"):
        merge(new_state(), new_state(FoldConfig(lateness_s=1.0)))


def test_drop_keys_forgets_keys_no_longer_owned() -> None:
    events = [make_event(level=level) for level in ("a", "b", "c")]
    state = fold(events)
    drop_keys(state, lambda key: key[1] != "b")
    assert set(snapshot(state, BASE)) == {(KEY[0], "a"), (KEY[0], "c")}


# --- config, histogram, throughput -----------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"bucket_s": {"5m": 7.0}},
        {"bucket_s": {"1w": 60.0}},
        {"bucket_s": {}},
        {"bucket_s": {"5m": 0.0}},
        {"lateness_s": -1.0},
        {"gate_band": (0.9, 0.8)},
        {"late_layers": 0},
    ],
)
def test_invalid_config_is_rejected(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        FoldConfig(**kwargs)


def test_a_subset_of_windows_can_be_kept() -> None:
    state = fold([make_event()], FoldConfig(bucket_s={"5m": 60.0}))
    assert list(snapshot(state, BASE)[KEY]) == ["5m"]


def test_snapshot_needs_an_aware_now() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        snapshot(new_state(), datetime(2025, 1, 1))


@given(values=st.lists(st.floats(0, 500_000), min_size=1, max_size=200), split=st.integers(0, 200))
def test_histogram_quantiles_bracket_the_exact_nearest_rank(
    values: list[float], split: int
) -> None:
    left, right = Histogram(), Histogram()
    for i, value in enumerate(values):
        (left if i < split else right).add(value)
    left.merge(right)
    check_quantiles(left.quantiles(), values)


def test_fold_throughput_reports_events_per_second() -> None:
    assert fold_throughput(2000) > 1000
    with pytest.raises(ValueError):
        fold_throughput(0)
