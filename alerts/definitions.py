"""What an alert rule is: `Rule`, its threshold kinds, and the vocabulary a rule may use
(metrics, windows, operators, severities, actions). Parsing lives in `alerts.rules`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

# Numeric `WindowSummary` fields (services/aggregator/windows.py), one sample per
# (model, level, window). Lists, dicts, quantiles and strings are not alertable.
WINDOW_METRICS = (
    "requests",
    "errors",
    "error_rate",
    "sparsity_mean",
    "sparsity_target",
    "gate_confidence_mean",
    "gate_outside_band_share",
    "activation_stability_mean",
    "gate_entropy_mean",
    "drift_kl_mean",
    "drift_samples",
    "silence_spikes",
    "silence_spike_share",
    "late_silence_mean",
    "layer_sparsity_shift",
    "signal_spread_ratio",
    "cache_hit_rate_mean",
)
# What a `Deviation` threshold compares a window with: the aggregator puts each one's centre,
# spread and tolerance in the sample as `baseline_<name>_center` / `_spread` / `_tolerance`
# (the calibration's healthy baseline, the key's own trailing 24 h for the cache hit rate, or
# the published numbers where neither exists).
BASELINE_SIGNALS = (
    "sparsity",
    "gate_confidence",
    "gate_entropy",
    "activation_stability",
    "drift_kl",
    "late_silence",
    "silence_spike",
    "cache_hit",
)
BASELINE_PARTS = ("center", "spread", "tolerance", "error")
# Samples without a window, produced by whoever watches the pipeline.
PIPELINE_METRICS = (
    "consumer_lag_events",
    "spool_bytes",
    "golden_check_age_s",
    "golden_drift",  # golden-set drift, points: the point estimate ...
    "golden_drift_low",  # ... and its 95 % interval's lower bound (what GoldenDriftHigh reads)
)
WINDOWS = ("5m", "1h", "24h")
ACTIONS = ("webhook", "recalibrate", "flag_finetune", "fallback")
# Set by the rule itself, so `labels` may not override them.
RESERVED_LABELS = ("alertname", "severity")

Op = Literal["<", ">", "outside"]
Severity = Literal["info", "warning", "critical"]
OPS: tuple[Op, ...] = ("<", ">", "outside")
SEVERITIES: tuple[Severity, ...] = ("info", "warning", "critical")


class RuleError(ValueError):
    """An invalid rules file; the message names the file, the line and the reason."""


@dataclass(frozen=True, slots=True)
class Relative:
    """A threshold of `factor` x the sample's `relative_to` value, or `default` when the sample
    has none (no default: the rule has no data for that sample)."""

    relative_to: str
    factor: float = 1.0
    default: float | None = None

    def bound(self, values: Mapping[str, float | None]) -> float | None:
        base = values.get(self.relative_to)
        return self.default if base is None else self.factor * base


@dataclass(frozen=True, slots=True)
class Deviation:
    """Beyond the baseline of `signal`: a window mean of n requests (n: the sample's `count`)
    further from the baseline's centre than the tolerance plus `z` standard errors of the
    difference, sqrt(spread^2 / n + error^2) (`error`: the centre's own standard error). The
    tolerance is the smallest effect worth an alert; the standard error makes a shortfall on
    few requests noise. No data while the sample lacks the baseline or the count."""

    signal: str
    z: float
    count: str = "requests"

    def names(self) -> tuple[str, ...]:
        return tuple(f"baseline_{self.signal}_{part}" for part in BASELINE_PARTS)

    def bounds(self, values: Mapping[str, float | None]) -> tuple[float, float] | None:
        center, spread, tolerance, error = (values.get(name) for name in self.names())
        n = values.get(self.count)
        if center is None or spread is None or tolerance is None or error is None:
            return None
        if n is None or n <= 0:
            return None
        margin = tolerance + self.z * math.sqrt(spread * spread / n + error * error)
        return center - margin, center + margin


Band = tuple[float, float]
Threshold = float | Band | Relative | Deviation
# Named signal values a rule's threshold may refer to (`{signal: gate_band}`); the services
# build it from their signal settings, so the rules and the gateway share one number.
Signals = Mapping[str, float | Band]


@dataclass(frozen=True)
class Rule:
    name: str
    metric: str
    window: str | None  # None for pipeline metrics
    op: Op
    threshold: Threshold  # Band or Deviation for "outside", any but Band for "<" and ">"
    min_requests: int = 1  # fewer requests in the window means no data; 0 for pipeline rules
    for_s: float = 0.0
    severity: Severity = "warning"
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    actions: tuple[str, ...] = ()

    def holds(self, value: float, values: Mapping[str, float | None]) -> bool | None:
        """Whether `value` breaks the threshold; None when a relative bound has no data."""
        if isinstance(self.threshold, Deviation):
            bounds = self.threshold.bounds(values)
            if bounds is None:
                return None
            low, high = bounds
            return {"<": value < low, ">": value > high}.get(self.op, value < low or value > high)
        if isinstance(self.threshold, tuple):
            low, high = self.threshold
            return value < low or value > high
        bound = self.threshold
        if isinstance(bound, Relative):
            found = bound.bound(values)
            if found is None:
                return None
            bound = found
        return value < bound if self.op == "<" else value > bound
