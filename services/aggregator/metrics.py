"""The aggregator's metrics. Counters and histograms count the events this instance folded
(each event is folded by exactly one instance, so `sum` over instances is the total); the
window gauges are exported only for the (model, level) keys this instance owns."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.aggregator.buckets import is_spike
from services.shared.metrics_table import MetricSpec, declare
from services.telemetry.schema import TelemetryEvent

KEY = ("model", "level")
RATIO = tuple(i / 20 for i in range(1, 21))
SECONDS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
WINDOW_GAUGES = {
    "requests": "sparseguard_window_requests",
    "error_rate": "sparseguard_window_error_ratio",
    "sparsity_mean": "sparseguard_window_sparsity_ratio",
    "sparsity_target": "sparseguard_window_sparsity_target_ratio",
    "gate_confidence_mean": "sparseguard_window_gate_confidence_ratio",
    "gate_outside_band_share": "sparseguard_window_gate_outside_band_ratio",
    "activation_stability_mean": "sparseguard_window_activation_stability_percent",
    "gate_entropy_mean": "sparseguard_window_gate_entropy_ratio",
    "drift_kl_mean": "sparseguard_window_semantic_drift_kl",
    "drift_samples": "sparseguard_window_semantic_drift_samples",
    "silence_spikes": "sparseguard_window_silence_spikes",
    "silence_spike_share": "sparseguard_window_silence_spike_ratio",
    "late_silence_mean": "sparseguard_window_late_silence_ratio",
    "layer_sparsity_shift": "sparseguard_window_layer_sparsity_shift",
    "signal_spread_ratio": "sparseguard_window_signal_spread_ratio",
    "cache_hit_rate_mean": "sparseguard_window_cache_hit_ratio",
}
# What each key's windows are compared with (services/aggregator/references.py), per signal.
BASELINE_GAUGES = {
    "baseline_center": "sparseguard_baseline_center",
    "baseline_spread": "sparseguard_baseline_spread",
    "baseline_tolerance": "sparseguard_baseline_tolerance",
    "baseline_error": "sparseguard_baseline_error",
}
# Every alert metric name -> its exported Prometheus series (the window gauges, and the
# pipeline series the gateway and the aggregator export), for `alerts.prometheus`.
ALERT_SERIES: dict[str, str] = {
    **WINDOW_GAUGES,
    **BASELINE_GAUGES,
    "consumer_lag_events": "sparseguard_aggregator_consumer_lag_events",
    "spool_bytes": "sparseguard_telemetry_spool_bytes",
    "golden_check_age_s": "sparseguard_golden_check_age_seconds",
    "golden_drift": "sparseguard_golden_drift_points",
    "golden_drift_low": "sparseguard_golden_drift_low_points",
}

AGGREGATOR_METRICS = (
    MetricSpec("events_total", Counter, "Telemetry events folded", (*KEY, "status")),
    MetricSpec("events_dead_lettered_total", Counter, "Events sent to the dead-letter topic"),
    MetricSpec("events_duplicate_total", Counter, "Replayed events skipped (already stored)"),
    MetricSpec("events_late_total", Counter, "Events dropped as later than the allowed lateness"),
    MetricSpec("request_sparsity_ratio", Histogram, "Per-request sparsity ratio", KEY, RATIO),
    MetricSpec(
        "request_gate_confidence_ratio", Histogram, "Per-request gate confidence", KEY, RATIO
    ),
    MetricSpec("request_semantic_drift_kl_sum", Counter, "Sum of sampled KL drift", KEY),
    MetricSpec("request_semantic_drift_samples_total", Counter, "Requests with KL drift", KEY),
    MetricSpec("request_latency_seconds", Histogram, "Request latency", KEY, SECONDS),
    MetricSpec("request_ttft_seconds", Histogram, "Time to first token", KEY, SECONDS),
    MetricSpec("request_cache_hit_ratio", Histogram, "Prefix cache hit rate", KEY, RATIO),
    MetricSpec("silence_spikes_total", Counter, "Requests with a late-layer silence spike", KEY),
    MetricSpec("trust_actions_total", Counter, "Trust actions taken", (*KEY, "action")),
    MetricSpec(
        "aggregator_consumer_lag_events", Gauge, "Events behind the log end", ("partition",)
    ),
    MetricSpec(
        "aggregator_batch_seconds", Histogram, "Poll-to-commit time of a batch", (), SECONDS
    ),
    MetricSpec("aggregator_event_to_fold_seconds", Histogram, "Event time to fold", (), SECONDS),
    *(
        MetricSpec(
            name.removeprefix("sparseguard_"), Gauge, f"{field} over the window", (*KEY, "window")
        )
        for field, name in WINDOW_GAUGES.items()
    ),
    *(
        MetricSpec(
            name.removeprefix("sparseguard_"),
            Gauge,
            f"Window reference {field.removeprefix('baseline_')} per signal",
            (*KEY, "signal"),
        )
        for field, name in BASELINE_GAUGES.items()
    ),
    MetricSpec("golden_check_age_seconds", Gauge, "Seconds since the last golden-set check"),
    MetricSpec("golden_drift_points", Gauge, "Latest golden-set drift (dense - sparse score)", KEY),
    MetricSpec("golden_drift_low_points", Gauge, "Its 95 % interval's lower bound", KEY),
    MetricSpec("golden_drift_high_points", Gauge, "Its 95 % interval's upper bound", KEY),
    MetricSpec("golden_drift_low_24h_points", Gauge, "Mean lower bound over 24 h", KEY),
    MetricSpec(
        "golden_drift_status", Gauge, "Latest golden check status (1 = current)", (*KEY, "status")
    ),
    MetricSpec(
        "job_runs", Gauge, "Background job runs stored, by kind and status", ("kind", "status")
    ),
    MetricSpec("model_flag", Gauge, "Standing model flags (1 = raised)", ("model", "flag")),
    MetricSpec(
        "window_silence_rate_ratio",
        Gauge,
        "Mean silence rate per layer over the window",
        (*KEY, "window", "layer"),
    ),
)


class AggregatorMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.m = declare(registry, AGGREGATOR_METRICS)
        self._window_labels: set[tuple[str, ...]] = set()
        self._silence_labels: set[tuple[str, ...]] = set()
        self._baseline_labels: set[tuple[str, ...]] = set()

    def counter(self, name: str) -> Counter:
        return cast(Counter, self.m[name])

    def histogram(self, name: str) -> Histogram:
        return cast(Histogram, self.m[name])

    def gauge(self, name: str) -> Gauge:
        return cast(Gauge, self.m[name])

    def observe(self, events: Iterable[TelemetryEvent], now: datetime) -> None:
        for e in events:
            key = (e.model, e.level)
            self.counter("events_total").labels(*key, e.status).inc()
            self.histogram("aggregator_event_to_fold_seconds").observe(
                max(0.0, (now - e.time).total_seconds())
            )
            self._observe_signals(e, key)
            if is_spike(e):  # the gateway's reason, as the windows count it
                self.counter("silence_spikes_total").labels(*key).inc()

    def _observe_signals(self, e: TelemetryEvent, key: tuple[str, str]) -> None:
        pairs = (
            ("request_sparsity_ratio", e.sparsity_ratio),
            ("request_gate_confidence_ratio", e.gate_confidence),
            ("request_cache_hit_ratio", e.cache_hit_rate),
            ("request_latency_seconds", e.total_ms / 1000 if e.total_ms is not None else None),
            ("request_ttft_seconds", e.ttft_ms / 1000 if e.ttft_ms is not None else None),
        )
        for name, value in pairs:
            if value is not None:
                self.histogram(name).labels(*key).observe(value)
        if e.semantic_drift_kl is not None:
            self.counter("request_semantic_drift_kl_sum").labels(*key).inc(e.semantic_drift_kl)
            self.counter("request_semantic_drift_samples_total").labels(*key).inc()
        if e.trust_action and e.trust_action != "none":
            self.counter("trust_actions_total").labels(*key, e.trust_action).inc()

    def set_windows(self, windows: Mapping[tuple[str, str], Mapping[str, object]]) -> None:
        """Export the owned keys' windows; series of keys no longer owned are removed."""
        current: set[tuple[str, ...]] = set()
        silence: set[tuple[str, ...]] = set()
        baseline: set[tuple[str, ...]] = set()
        for (model, level), by_window in windows.items():
            for window, summary in by_window.items():
                current.add((model, level, window))
                silence |= self._set_window((model, level, window), summary)
                baseline |= self._set_references((model, level), summary)
        for labels in self._baseline_labels - baseline:
            for name in BASELINE_GAUGES.values():
                self.gauge(name.removeprefix("sparseguard_")).remove(*labels)
        self._baseline_labels = baseline
        for labels in self._window_labels - current:
            for name in WINDOW_GAUGES.values():
                self.gauge(name.removeprefix("sparseguard_")).remove(*labels)
        for labels in self._silence_labels - silence:
            self.gauge("window_silence_rate_ratio").remove(*labels)
        self._window_labels, self._silence_labels = current, silence

    def _set_references(self, key: tuple[str, str], summary: object) -> set[tuple[str, ...]]:
        exported: set[tuple[str, ...]] = set()
        refs: Mapping[str, object] = getattr(summary, "references", {}) or {}
        for signal, ref in refs.items():
            for field, name in BASELINE_GAUGES.items():
                value = getattr(ref, field.removeprefix("baseline_"))
                self.gauge(name.removeprefix("sparseguard_")).labels(*key, signal).set(value)
            exported.add((*key, signal))
        return exported

    def _set_window(self, labels: tuple[str, str, str], summary: object) -> set[tuple[str, ...]]:
        for field, name in WINDOW_GAUGES.items():
            value = getattr(summary, field, None)
            gauge = self.gauge(name.removeprefix("sparseguard_")).labels(*labels)
            gauge.set(float("nan") if value is None else float(value))
        exported: set[tuple[str, ...]] = set()
        for layer, rate in enumerate(getattr(summary, "silence_rate_per_layer", []) or []):
            self.gauge("window_silence_rate_ratio").labels(*labels, str(layer)).set(rate)
            exported.add((*labels, str(layer)))
        return exported
