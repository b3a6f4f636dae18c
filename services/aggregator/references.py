"""What each window is compared with (`Reference`: centre, spread of one request's value, and
the tolerance a window mean may move on healthy traffic): the healthy baseline the key's
calibration measured, the key's own trailing 24 h for the prefix cache hit rate, and the
published numbers in the signal settings where neither exists. Alert rules with a
`{baseline: NAME}` threshold read them (alerts.definitions.Deviation); the aggregator exports
them as `sparseguard_baseline_*{signal=NAME}` gauges for the Prometheus rules.

The baseline is read from the calibration artefact's JSON (`baseline.signals.<name>.mean`,
`.sd`, `.tolerance`; sparse_engine/calibration/baseline.py writes it), so the aggregator needs
neither torch nor the engine."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.config import SignalSettings

# Reference name (alerts.definitions.BASELINE_SIGNALS) -> the artefact's per-request signal.
FROM_BASELINE = {
    "sparsity": "sparsity_ratio",
    "gate_confidence": "gate_confidence",
    "gate_entropy": "gate_entropy",
    "activation_stability": "activation_stability_pct",
    "drift_kl": "semantic_drift_kl",
    "late_silence": "late_silence",
}
MIN_TRAILING = 200  # requests in the trailing 24 h before it is the cache hit rate's reference


@dataclass(frozen=True, slots=True)
class Reference:
    center: float
    spread: float  # standard deviation of one request's value
    tolerance: float  # the smallest move of a window mean worth an alert
    source: str  # baseline | trailing-24h | published
    error: float = 0.0  # the centre's own standard error (a mean of a sample; 0: exact)

    def to_dict(self) -> dict[str, Any]:
        return {
            "center": self.center,
            "spread": self.spread,
            "tolerance": self.tolerance,
            "error": self.error,
            "source": self.source,
        }


def baseline_references(artefact_baseline: Mapping[str, Any] | None) -> dict[str, Reference]:
    """The references a calibration's baseline gives (empty without one)."""
    if not artefact_baseline:
        return {}
    stats = artefact_baseline.get("signals", {})
    return {
        name: Reference(
            float(s["mean"]),
            float(s["sd"]),
            float(s["tolerance"]),
            "baseline",
            float(s["sd"]) / math.sqrt(s["n"]),
        )
        for name, signal in FROM_BASELINE.items()
        if (s := stats.get(signal)) is not None
    }


def layer_sparsity(artefact_baseline: Mapping[str, Any] | None) -> list[Reference]:
    """Each layer's sparsity reference (empty without a baseline)."""
    layers = (artefact_baseline or {}).get("sparsity_per_layer", [])
    return [
        Reference(s["mean"], s["sd"], s["tolerance"], "baseline", s["sd"] / math.sqrt(s["n"]))
        for s in layers
    ]


def layer_shift(sums: list[float], counts: list[int], layers: list[Reference]) -> float | None:
    """How far the most shifted layer's window mean sparsity is from its baseline: the largest
    (|mean - centre| - tolerance) / sqrt(spread^2 / n + error^2) over layers, in standard
    errors (a healthy window stays below a few; a layer whose MLP stopped working moves its
    neighbours' sparsity by many). None without a baseline or requests."""
    found = [
        (abs(total / n - ref.center) - ref.tolerance) / math.sqrt(ref.spread**2 / n + ref.error**2)
        for total, n, ref in zip(sums, counts, layers, strict=False)
        if n > 0 and (ref.spread > 0 or ref.error > 0)
    ]
    return max(found) if found else None


def spread_bound(n: int, sd: float, z: float) -> float:
    """Upper confidence bound on the standard deviation behind `n` values whose population sd
    is `sd`: sqrt((n - 1) s^2 / q) with s^2 the unbiased variance and q the chi-square
    (n - 1 degrees of freedom) quantile `z` standard normal deviations below its centre
    (Wilson-Hilferty). Infinite for n < 2 or where the approximation gives no positive q."""
    k = n - 1
    if k < 1:
        return math.inf
    q = k * (1 - 2 / (9 * k) - z * math.sqrt(2 / (9 * k))) ** 3
    return math.sqrt(sd * sd * n / q) if q > 0 else math.inf


def spread_ratio(windows: list[tuple[int, float, Reference]], z: float) -> float | None:
    """How much a window's requests vary against healthy traffic: over the signals with a
    measured baseline, the largest ratio of the window's spread (its upper confidence bound,
    `spread_bound`) to the baseline's per-request sd. Healthy traffic sits near 1 or above;
    one prompt repeated gives nearly the same signals every time and a ratio near 0. Each
    item is (values, window sd, reference); None where no signal has a baseline."""
    found = [
        spread_bound(n, sd, z) / ref.spread
        for n, sd, ref in windows
        if ref.source == "baseline" and ref.spread > 0 and n >= 2
    ]
    return max(found) if found else None


def spike_reference(signals: SignalSettings, measured: bool) -> Reference:
    """The share of requests with a silence-spike reason. Against a baseline the reason fires
    on `reason_budget` of healthy requests (a binomial share); the published rule alerts over
    5 % of requests."""
    if not measured:
        return Reference(0.0, 0.0, 0.05, "published")
    p = signals.reason_budget
    return Reference(p, math.sqrt(p * (1 - p)), signals.spike_share_effect, "baseline")


def cache_reference(
    signals: SignalSettings, trailing_n: int, trailing_mean: float | None, trailing_sd: float
) -> Reference | None:
    """The key's own trailing 24 h hit rate once it holds MIN_TRAILING requests (a drop by
    `cache_drop_effect` of it is the smallest worth an alert), else none:
    a workload without shared prefixes never had a high hit rate, so the published floor
    (signals.cache_hit_min) would alarm on it from the first request; it is not used."""
    if trailing_mean is None or trailing_n < MIN_TRAILING:
        return None
    return Reference(
        trailing_mean,
        trailing_sd,
        signals.cache_drop_effect * trailing_mean,
        "trailing-24h",
        trailing_sd / math.sqrt(trailing_n),
    )


def published(signals: SignalSettings, target: float | None) -> dict[str, Reference]:
    """The published numbers as references with no spread: the old fixed thresholds."""
    low, high = signals.gate_band
    return {
        "sparsity": Reference(
            target if target is not None else signals.sparsity_target_default, 0.0, 0.0, "published"
        ),
        "gate_confidence": Reference((low + high) / 2, 0.0, (high - low) / 2, "published"),
        "gate_entropy": Reference(signals.gate_uniform_entropy, 0.0, 0.0, "published"),
        "drift_kl": Reference(signals.drift_kl_24h, 0.0, 0.0, "published"),
    }


def references(
    signals: SignalSettings,
    artefact_baseline: Mapping[str, Any] | None,
    target: float | None,
    trailing: tuple[int, float | None, float],
) -> dict[str, Reference]:
    """Every reference of one key: the baseline's where measured, else the published ones;
    `trailing`: (requests, mean, sd) of the cache hit rate over the key's 24 h window."""
    measured = baseline_references(artefact_baseline)
    found = {**published(signals, target), **measured}
    found["silence_spike"] = spike_reference(signals, bool(measured))
    cache = cache_reference(signals, *trailing)
    if cache is not None:
        found["cache_hit"] = cache
    return found
