"""How sure a threshold from a finite healthy sample is to hold its false-alarm budget: which
order statistic of the sample to fire past, and with what confidence over the draw of the
sample (the conformal p-value holds a budget on average over samples only)."""

from __future__ import annotations

import math
from functools import lru_cache


@lru_cache(maxsize=4096)  # asked per request and kind, of a few sample sizes
def ceiling_rank(n: int, budget: float, confidence: float = 0.0) -> int:
    """How few of `n` healthy values a value must reach for it to be unusual: it fires when
    fewer than k of them are at or above it. The conformal rule takes k = floor(budget (n+1))
    (at most `budget` false alarms on average over samples); this takes the largest k up to
    that for which one sample's false-alarm rate is at most `budget` with `confidence`. That
    rate, past the k-th largest of n, is Beta(k, n + 1 - k): P(rate <= budget) =
    P(Binomial(n, budget) >= k). Where even k = 1 (past the largest) cannot reach the
    confidence (n < log(1 - confidence) / log(1 - budget): 230 for 1 % at 90 %), k is 1 and
    the budget holds on average only (`binomial_tail` says how sure). 0: never (n too few
    to spend the budget at all). `confidence` 0: the conformal rule."""
    most = math.floor(budget * (n + 1) + 1e-9)
    return min(most, max(1, confident_rank(n, budget, confidence, most)))


def confident_rank(n: int, budget: float, confidence: float, most: int | None = None) -> int:
    """The largest k (at most `most`, default n) with P(Binomial(n, budget) >= k) >=
    `confidence`: past the k-th largest (or under the k-th smallest) of `n` healthy values
    lies at most `budget` of healthy traffic with that confidence. 0 when k = 1 falls short."""
    top = n if most is None else min(most, n)
    k = 0
    while k < top and binomial_tail(n, budget, k + 1) >= confidence:
        k += 1
    return k


def binomial_tail(n: int, p: float, k: int) -> float:
    """P(Binomial(n, p) >= k), summed in log space (no overflow for large n): how sure it is
    that firing past the k-th largest of `n` healthy values fires on at most `p` of them."""
    if p <= 0.0:
        return 1.0 if k <= 0 else 0.0
    if p >= 1.0:
        return 1.0 if k <= n else 0.0

    def log_term(i: int) -> float:
        return (
            math.lgamma(n + 1)
            - math.lgamma(i + 1)
            - math.lgamma(n - i + 1)
            + i * math.log(p)
            + (n - i) * math.log1p(-p)
        )

    return sum(math.exp(log_term(i)) for i in range(max(k, 0), n + 1))


def sample_needed(budget: float, confidence: float) -> int:
    """The smallest sample whose largest value holds `budget` with `confidence`."""
    return math.ceil(math.log1p(-confidence) / math.log1p(-budget) - 1e-9)
