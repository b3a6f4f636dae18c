"""Metrics declared once from a table against an injected registry (no globals)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

PREFIX = "sparseguard_"


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str  # without the prefix; counters end in _total
    kind: type[MetricWrapperBase]
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None


def declare(
    registry: CollectorRegistry, specs: tuple[MetricSpec, ...]
) -> dict[str, MetricWrapperBase]:
    metrics: dict[str, MetricWrapperBase] = {}
    for spec in specs:
        full = PREFIX + spec.name
        if spec.kind is Counter:
            # prometheus_client appends _total itself
            metrics[spec.name] = Counter(
                full.removesuffix("_total"), spec.help, spec.labels, registry=registry
            )
        elif spec.kind is Histogram:
            buckets = spec.buckets or Histogram.DEFAULT_BUCKETS
            metrics[spec.name] = Histogram(
                full, spec.help, spec.labels, registry=registry, buckets=buckets
            )
        elif spec.kind is Gauge:
            metrics[spec.name] = Gauge(full, spec.help, spec.labels, registry=registry)
        else:
            raise ValueError(f"unsupported metric kind {spec.kind.__name__}")
    return metrics
