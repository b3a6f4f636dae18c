"""The pure rolling-window fold: hand-made known answers for every summary field, lateness,
bounded memory, config checks and key dropping."""

from __future__ import annotations

import json
import math
import random
from datetime import datetime
from typing import Any

import pytest

from services.aggregator.histograms import NUM_BINS
from services.aggregator.summary import WindowSummary
from services.aggregator.synthetic import fold_throughput
from services.aggregator.windows import (
    WINDOWS,
    FoldConfig,
    apply,
    new_state,
    snapshot,
)
from services.telemetry.schema import REASON_LOW_SCORE, REASON_SILENCE_SPIKE, TelemetryEvent
from tests.window_fixtures import (
    BASE,
    KEY,
    SUMMARY_MEANS,
    fold,
    make_event,
    secs,
)

# --- known answers -------------------------------------------------------------------------


def hand_made_events() -> list[TelemetryEvent]:
    # The fold counts the spike the gateway judged (the reason), not the silence it carries.
    spike = {
        "silence_rate_per_layer": [0.1, 0.9, 0.9, 0.9],
        "trust_action": "flag",
        "trust_reasons": [REASON_SILENCE_SPIKE, REASON_LOW_SCORE],
    }
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
            trust_reasons=[REASON_LOW_SCORE],
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
        assert summary.late_silence_mean == pytest.approx((0.9 + 0.1 + 0.65) / 3)  # last 3
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


def test_layer_sparsity_shift_counts_standard_errors_beyond_each_layers_tolerance() -> None:
    layer = {"mean": 0.40, "sd": 0.02, "tolerance": 0.01, "n": 100}
    baseline = {"signals": {}, "sparsity_per_layer": [layer, layer]}
    events = [make_event(secs(i), sparsity_per_layer=[0.40, 0.36]) for i in range(25)]
    [summary] = [
        w["5m"] for w in snapshot(fold(events), secs(30), baselines={"cal-1": baseline}).values()
    ]
    assert summary.sparsity_per_layer == pytest.approx([0.40, 0.36])
    # layer 1: (0.04 - 0.01) / sqrt(0.02^2 / 25 + 0.02^2 / 100)
    assert summary.layer_sparsity_shift == pytest.approx(0.03 / math.sqrt(0.0004 / 25 + 4e-6))
    no_baseline = snapshot(fold(events), secs(30))[KEY]["5m"]
    assert no_baseline.layer_sparsity_shift is None


def test_signal_spread_ratio_bounds_the_windows_spread_against_the_baselines() -> None:
    """25 requests whose sparsity alternates 0.40 / 0.44, against a baseline sd of 0.04: the
    chi-square upper bound (z = 4) of their sd over 0.04; the same request repeated gives 0."""
    sparsity = {"mean": 0.42, "sd": 0.04, "tolerance": 0.01, "n": 100}
    baseline = {"signals": {"sparsity_ratio": sparsity}, "sparsity_per_layer": []}
    values = [0.40 if i % 2 else 0.44 for i in range(25)]
    events = [make_event(secs(i), sparsity_ratio=v) for i, v in enumerate(values)]
    [summary] = [
        w["5m"] for w in snapshot(fold(events), secs(30), baselines={"cal-1": baseline}).values()
    ]
    mean = sum(values) / 25
    unbiased = sum((v - mean) ** 2 for v in values) / 24
    chi2_low = 24 * (1 - 2 / 216 - 4 * math.sqrt(2 / 216)) ** 3
    assert summary.signal_spread_ratio == pytest.approx(math.sqrt(24 * unbiased / chi2_low) / 0.04)
    same = [make_event(secs(i), sparsity_ratio=0.42) for i in range(25)]
    [alike] = [
        w["5m"] for w in snapshot(fold(same), secs(30), baselines={"cal-1": baseline}).values()
    ]
    assert alike.signal_spread_ratio == pytest.approx(0.0, abs=1e-6)
    assert snapshot(fold(events), secs(30))[KEY]["5m"].signal_spread_ratio is None


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
        trust_reasons=[REASON_SILENCE_SPIKE],
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
    assert state.events_applied == 100_000 and state.late_dropped == 0
    for entry in state.keys.values():
        assert {w: sum(b is not None for b in r.slots) for w, r in entry.rings.items()} == sizes
        buckets = [b for r in entry.rings.values() for b in r.slots if b is not None]
        assert all(len(b.silence.sums) == 4 and len(b.latency.counts) <= NUM_BINS for b in buckets)


# --- brute force reference (Hypothesis) ------------------------------------------------------


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


def test_fold_throughput_reports_events_per_second() -> None:
    assert fold_throughput(2000) > 1000
    with pytest.raises(ValueError):
        fold_throughput(0)
