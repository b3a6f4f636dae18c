"""What one rolling window says at a moment: the summary the fold produces for readers."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any

from services.aggregator.histograms import Quantiles
from services.aggregator.references import Reference


@dataclass(frozen=True, slots=True)
class WindowSummary:
    window: str
    start: datetime
    end: datetime
    requests: int
    errors: int
    error_rate: float
    sparsity_mean: float | None
    sparsity_target: float | None
    gate_confidence_mean: float | None
    gate_outside_band_share: float | None
    activation_stability_mean: float | None
    gate_entropy_mean: float | None  # saliency entropy; gate degraded above gate_uniform_entropy
    drift_kl_mean: float | None
    drift_samples: int
    silence_rate_per_layer: list[float]
    late_silence_mean: float | None  # mean late-band silence (the silence-spike signal)
    sparsity_per_layer: list[float]
    # The largest per-layer sparsity shift against the baseline, in standard errors beyond
    # the layer's tolerance (services/aggregator/references.py layer_shift); None without one.
    layer_sparsity_shift: float | None
    # How much the requests' signals vary against healthy traffic's (references.spread_ratio):
    # near 0 when one prompt is sent over and over; None without a baseline.
    signal_spread_ratio: float | None
    silence_spikes: int
    silence_spike_share: float | None
    trust_actions: dict[str, int]
    cache_hit_rate_mean: float | None
    ttft_ms: Quantiles | None
    latency_ms: Quantiles | None
    calibration_version: str | None
    # What alert rules compare this window with, by name (services/aggregator/references.py).
    references: dict[str, Reference] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: times as ISO 8601 UTC with Z, quantiles as nested objects."""
        out: dict[str, Any] = {}
        for item in fields(self):
            value = getattr(self, item.name)
            if isinstance(value, datetime):
                value = value.isoformat().replace("+00:00", "Z")
            elif isinstance(value, Quantiles):
                value = value.to_dict()
            elif item.name == "references":
                value = {name: ref.to_dict() for name, ref in value.items()}
            elif isinstance(value, list | dict):
                value = copy.copy(value)
            out[item.name] = value
        return out
