"""What one telemetry event adds to a window: its `Observation` (computed once per event) and
the `Bucket` of running sums it is added to, one per window; services/aggregator/windows.py
keeps the rings of buckets."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from services.aggregator.histograms import Histogram
from services.telemetry.schema import REASON_SILENCE_SPIKE, TelemetryEvent

# Signals averaged per window, in the order of Bucket.sums / Bucket.counts.
MEAN_FIELDS = (
    "sparsity_ratio",
    "gate_confidence",
    "activation_stability_pct",
    "semantic_drift_kl",
    "cache_hit_rate",
    "gate_entropy",
    "late_silence",  # the mean silence of the last `late_band` layers (not an event field)
)
SPARSITY, GATE, STABILITY, DRIFT, CACHE, ENTROPY, LATE_SILENCE = range(len(MEAN_FIELDS))


@dataclass(slots=True)
class LayerSums:
    """Running sums of a per-layer signal (silence or sparsity per layer)."""

    sums: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)

    def add(self, values: list[float | None]) -> None:
        self._grow(len(values))
        for layer, value in enumerate(values):
            if value is not None:
                self.sums[layer] += value
                self.counts[layer] += 1

    def merge(self, other: LayerSums) -> None:
        self._grow(len(other.sums))
        for layer, count in enumerate(other.counts):
            self.sums[layer] += other.sums[layer]
            self.counts[layer] += count

    def means(self) -> list[float]:
        return [s / n if n else 0.0 for s, n in zip(self.sums, self.counts, strict=True)]

    def _grow(self, num_layers: int) -> None:
        missing = num_layers - len(self.sums)
        if missing > 0:
            self.sums.extend([0.0] * missing)
            self.counts.extend([0] * missing)


@dataclass(slots=True)
class Observation:
    """What one event contributes, computed once and added to one bucket per window."""

    is_error: bool
    values: list[float | None]  # aligned with MEAN_FIELDS
    gate_outside: bool = False
    silence: list[float | None] = field(default_factory=list)
    sparsity: list[float | None] = field(default_factory=list)
    spike: bool = False
    trust_action: str | None = None
    ttft_ms: float | None = None
    total_ms: float | None = None


def is_spike(event: TelemetryEvent) -> bool:
    """Whether the gateway judged the request a late-layer silence spike."""
    return event.status != "error" and REASON_SILENCE_SPIKE in event.trust_reasons


def observe(event: TelemetryEvent, gate_band: tuple[float, float], late_band: int) -> Observation:
    if event.status == "error":
        return Observation(is_error=True, values=[None] * len(MEAN_FIELDS))
    values = [_finite(getattr(event, name)) for name in MEAN_FIELDS[:LATE_SILENCE]]
    gate = values[GATE]
    silence = [_finite(rate) for rate in event.silence_rate_per_layer]
    band = [rate for rate in silence[-late_band:] if rate is not None]
    values.append(sum(band) / len(band) if band else None)
    action = event.trust_action if event.trust_action != "none" else None
    return Observation(
        is_error=False,
        values=values,
        gate_outside=gate is not None and not gate_band[0] <= gate <= gate_band[1],
        silence=silence,
        sparsity=[_finite(rate) for rate in event.sparsity_per_layer],
        spike=is_spike(event),
        trust_action=action,
        ttft_ms=_finite(event.ttft_ms),
        total_ms=_finite(event.total_ms),
    )


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


@dataclass(slots=True)
class Bucket:
    """Running sums of one time bucket (index = floor(epoch seconds / bucket_s))."""

    index: int
    requests: int = 0
    errors: int = 0
    sums: list[float] = field(default_factory=lambda: [0.0] * len(MEAN_FIELDS))
    squares: list[float] = field(default_factory=lambda: [0.0] * len(MEAN_FIELDS))
    counts: list[int] = field(default_factory=lambda: [0] * len(MEAN_FIELDS))
    gate_outside: int = 0
    silence: LayerSums = field(default_factory=LayerSums)
    sparsity: LayerSums = field(default_factory=LayerSums)
    spikes: int = 0
    trust_actions: dict[str, int] = field(default_factory=dict)
    ttft: Histogram = field(default_factory=Histogram)
    latency: Histogram = field(default_factory=Histogram)

    def add(self, obs: Observation) -> None:
        self.requests += 1
        if obs.is_error:
            self.errors += 1
            return
        for i, value in enumerate(obs.values):
            if value is not None:
                self.sums[i] += value
                self.squares[i] += value * value
                self.counts[i] += 1
        self.gate_outside += obs.gate_outside
        self.spikes += obs.spike
        self.silence.add(obs.silence)
        self.sparsity.add(obs.sparsity)
        if obs.trust_action is not None:
            self.trust_actions[obs.trust_action] = self.trust_actions.get(obs.trust_action, 0) + 1
        if obs.ttft_ms is not None:
            self.ttft.add(obs.ttft_ms)
        if obs.total_ms is not None:
            self.latency.add(obs.total_ms)

    def merge(self, other: Bucket) -> None:
        self.requests += other.requests
        self.errors += other.errors
        self.sums = [a + b for a, b in zip(self.sums, other.sums, strict=True)]
        self.squares = [a + b for a, b in zip(self.squares, other.squares, strict=True)]
        self.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        self.gate_outside += other.gate_outside
        self.spikes += other.spikes
        self.silence.merge(other.silence)
        self.sparsity.merge(other.sparsity)
        for action, count in other.trust_actions.items():
            self.trust_actions[action] = self.trust_actions.get(action, 0) + count
        self.ttft.merge(other.ttft)
        self.latency.merge(other.latency)

    def mean(self, i: int) -> float | None:
        return self.sums[i] / self.counts[i] if self.counts[i] else None

    def sd(self, i: int) -> float:
        """Population standard deviation of field `i` (0 without values)."""
        mean = self.mean(i)
        if mean is None:
            return 0.0
        return math.sqrt(max(0.0, self.squares[i] / self.counts[i] - mean * mean))
