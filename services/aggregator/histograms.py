"""Fixed log-spaced latency histograms: the bin edges (1 ms .. ~126 s, 20 bins per decade), a
mergeable `Histogram` of counts per bin plus the observed maximum, and `Quantiles` read back from
its cumulative counts.

Quantile rule (documented contract): nearest rank, rank = ceil(p * count / 100); the value
reported is the *upper edge* of the bin holding that rank, capped at the largest value observed.
No interpolation, so the answer never underestimates the true nearest-rank quantile and
overestimates it by at most one bin width (edges grow by 10**(1/20), about 12%); values above the
last edge land in an overflow bin whose quantile is the observed maximum. Because every histogram
shares the same edges, partial histograms merge exactly by adding counts.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any

EDGES_PER_DECADE = 20
NUM_DECADES = 5.1  # 10**5.1 ms ~ 126 s, past the 120 s request ceiling
LATENCY_EDGES_MS: tuple[float, ...] = tuple(
    10 ** (i / EDGES_PER_DECADE) for i in range(round(NUM_DECADES * EDGES_PER_DECADE) + 1)
)
NUM_BINS = len(LATENCY_EDGES_MS) + 1  # bin i holds (edge[i-1], edge[i]]; the last is overflow
PERCENTILES = (50, 90, 99)


def bin_index(value_ms: float) -> int:
    """The bin holding `value_ms`: 0 for <= 1 ms, NUM_BINS - 1 for above the last edge."""
    return bisect_left(LATENCY_EDGES_MS, value_ms)


def upper_edge(index: int) -> float:
    return LATENCY_EDGES_MS[index] if index < len(LATENCY_EDGES_MS) else math.inf


@dataclass(frozen=True, slots=True)
class Quantiles:
    """p50/p90/p99 in ms (upper bin edge, capped at `max`), over `count` observations."""

    p50: float
    p90: float
    p99: float
    count: int
    max: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "p50": self.p50,
            "p90": self.p90,
            "p99": self.p99,
            "count": self.count,
            "max": self.max,
        }


@dataclass(slots=True)
class Histogram:
    """Counts per bin (sparse: only bins that were hit) and the largest value seen."""

    counts: dict[int, int] = field(default_factory=dict)
    max: float = -math.inf

    def add(self, value_ms: float) -> None:
        index = bin_index(value_ms)
        self.counts[index] = self.counts.get(index, 0) + 1
        if value_ms > self.max:
            self.max = value_ms

    def merge(self, other: Histogram) -> None:
        for index, count in other.counts.items():
            self.counts[index] = self.counts.get(index, 0) + count
        self.max = max(self.max, other.max)

    @property
    def count(self) -> int:
        return sum(self.counts.values())

    def quantiles(self) -> Quantiles | None:
        total = self.count
        if total == 0:
            return None
        p50, p90, p99 = (self._value_at_rank(-(-p * total // 100)) for p in PERCENTILES)
        return Quantiles(p50=p50, p90=p90, p99=p99, count=total, max=self.max)

    def _value_at_rank(self, rank: int) -> float:
        seen = 0
        for index in sorted(self.counts):
            seen += self.counts[index]
            if seen >= rank:
                return min(upper_edge(index), self.max)
        return self.max  # unreachable for 1 <= rank <= count
