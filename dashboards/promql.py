"""PromQL fragments shared by the dashboards. `$model`, `$level` and `$__rate_interval` are
Grafana template variables; `dashboards.queries()` substitutes them for a plain Prometheus."""

from __future__ import annotations

from dashboards.model import Target

KEY = 'model=~"$model", level=~"$level"'
QUANTILES = (0.5, 0.95, 0.99)


def select(metric: str, selector: str = KEY) -> str:
    return f"{metric}{{{selector}}}" if selector else metric


def window(metric: str, name: str = "5m") -> str:
    """An aggregator window gauge of the selected keys."""
    return select(metric, f'{KEY}, window="{name}"')


def rate(metric: str, by: str, selector: str = KEY) -> str:
    """Per-second rate of a counter, summed by the labels `by` (empty: one total)."""
    grouping = f"sum by ({by})" if by else "sum"
    return f"{grouping} (rate({select(metric, selector)}[$__rate_interval]))"


def quantiles(histogram: str, selector: str = KEY) -> tuple[Target, ...]:
    """p50/p95/p99 of a histogram (its base name) over all selected series."""
    buckets = f"rate({select(histogram + '_bucket', selector)}[$__rate_interval])"
    return tuple(
        Target(f"histogram_quantile({q}, sum by (le) ({buckets}))", f"p{round(q * 100)}")
        for q in QUANTILES
    )
