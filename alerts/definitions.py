"""What an alert rule is: `Rule`, its threshold kinds, and the vocabulary a rule may use
(metrics, windows, operators, severities, actions). Parsing lives in `alerts.rules`."""

from __future__ import annotations

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
    "cache_hit_rate_mean",
)
# Samples without a window, produced by whoever watches the pipeline.
PIPELINE_METRICS = (
    "consumer_lag_events",
    "spool_bytes",
    "golden_check_age_s",
    "golden_drift_bleu",
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


Band = tuple[float, float]
Threshold = float | Band | Relative
# Named signal values a rule's threshold may refer to (`{signal: gate_band}`); the services
# build it from their signal settings, so the rules and the gateway share one number.
Signals = Mapping[str, float | Band]


@dataclass(frozen=True)
class Rule:
    name: str
    metric: str
    window: str | None  # None for pipeline metrics
    op: Op
    threshold: Threshold  # Band for "outside", a float or Relative for "<" and ">"
    min_requests: int = 1  # fewer requests in the window means no data; 0 for pipeline rules
    for_s: float = 0.0
    severity: Severity = "warning"
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    actions: tuple[str, ...] = ()

    def holds(self, value: float, values: Mapping[str, float | None]) -> bool | None:
        """Whether `value` breaks the threshold; None when a relative bound has no data."""
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
