"""Golden-set scoring: each answer against its item's external reference with the metric the
item names (token F1 for short answers, chrF or sentence BLEU-4 for long ones, all 0-100), and
one level's drift from the per-item scores: the mean paired difference dense - sparse with a
seeded paired-bootstrap 95 % interval, and the status that interval gives against a budget.

Status: `over-budget` when the interval's lower bound is above the budget (the sparse level is
worse by more than the budget, beyond sampling noise), `ok` when its upper bound is at or below
it, `inconclusive` otherwise (the golden set cannot tell)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import sacrebleu

from services.storage.models import GOLDEN_STATUSES
from services.workers.golden_set import GoldenItem
from sparse_engine.trust.qa import token_f1

OK, INCONCLUSIVE, OVER_BUDGET = STATUSES = GOLDEN_STATUSES
RESAMPLES = 2000
SEED = 0
CONFIDENCE = 0.95
PREVIEW_CHARS = 400  # whole answers at the default 64 tokens, to read what changed

Scorer = Callable[[str, str], float]


def f1_points(answer: str, reference: str) -> float:
    """SQuAD token F1 (normalised: lower case, no punctuation or articles), in points."""
    return 100.0 * token_f1(answer, reference)


def chrf_points(answer: str, reference: str) -> float:
    """sacreBLEU sentence chrF (character 6-grams, beta 2)."""
    return float(sacrebleu.sentence_chrf(answer, [reference]).score)


def bleu_points(answer: str, reference: str) -> float:
    """sacreBLEU sentence BLEU-4 (13a tokenization, exp smoothing)."""
    return float(sacrebleu.sentence_bleu(answer, [reference]).score)


SCORERS: dict[str, Scorer] = {"f1": f1_points, "chrf": chrf_points, "bleu": bleu_points}


def score(metric: str, answer: str, reference: str) -> float:
    scorer = SCORERS.get(metric)
    if scorer is None:
        raise ValueError(f"unknown golden metric {metric!r}; choose one of: {', '.join(SCORERS)}")
    return scorer(answer, reference)


@dataclass(frozen=True, slots=True)
class Interval:
    mean: float
    low: float
    high: float


def paired_bootstrap(
    differences: Sequence[float],
    resamples: int = RESAMPLES,
    seed: int = SEED,
    confidence: float = CONFIDENCE,
) -> Interval:
    """The mean of the paired differences and its percentile-bootstrap interval: items are
    resampled with replacement `resamples` times (a seeded numpy generator, so one set of
    answers always gives one interval)."""
    values = np.asarray(differences, dtype=np.float64)
    if values.ndim != 1 or values.size == 0:
        raise ValueError("the bootstrap needs at least one paired difference")
    if not np.isfinite(values).all():
        raise ValueError("paired differences must be finite numbers")
    if resamples < 1 or not 0.0 < confidence < 1.0:
        raise ValueError("the bootstrap needs resamples >= 1 and 0 < confidence < 1")
    picks = np.random.default_rng(seed).integers(0, values.size, size=(resamples, values.size))
    means = values[picks].mean(axis=1)
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    mean = float(values.mean())
    # A resampled mean of equal values can differ from them in the last bit; keep the interval
    # around the estimate (identical answers then give exactly [0, 0]).
    return Interval(mean, min(float(low), mean), max(float(high), mean))


def drift_status(low: float, high: float, budget: float) -> str:
    if low > budget:
        return OVER_BUDGET
    if high <= budget:
        return OK
    return INCONCLUSIVE


@dataclass(frozen=True, slots=True)
class LevelDrift:
    """One level's result of a golden-set check, in points of the items' metrics (0-100)."""

    level: str
    calibration_version: str
    metric: str  # the items' metrics joined by "+", e.g. "chrf+f1"
    score_dense: float  # mean per-item score of the dense answers
    score_sparse: float
    drift: float  # mean over items of (dense score - sparse score)
    drift_low: float  # its paired-bootstrap 95 % interval
    drift_high: float
    kl_mean: float
    answers_changed: int
    prompts: int
    details: dict[str, Any] = field(default_factory=dict)

    def status(self, budget: float) -> str:
        return drift_status(self.drift_low, self.drift_high, budget)

    def over_budget(self, budget: float) -> bool:
        return self.status(budget) == OVER_BUDGET

    @property
    def changed_share(self) -> float:
        return self.answers_changed / self.prompts if self.prompts else 0.0

    def figures(self, budget: float) -> dict[str, Any]:
        """The figures a job result or a report shows, rounded."""
        return {
            "metric": self.metric,
            "drift": round(self.drift, 3),
            "drift_low": round(self.drift_low, 3),
            "drift_high": round(self.drift_high, 3),
            "status": self.status(budget),
            "over_budget": self.over_budget(budget),
            "score_dense": round(self.score_dense, 2),
            "score_sparse": round(self.score_sparse, 2),
            "answers_changed": self.answers_changed,
            "answers_changed_share": round(self.changed_share, 3),
            "kl_mean": round(self.kl_mean, 4),
        }


def summarize(
    level: str,
    calibration_version: str,
    items: Sequence[GoldenItem],
    dense: Sequence[str],
    sparse: Sequence[str],
    kls: Sequence[float],
) -> LevelDrift:
    """One level's drift from the dense and sparse answers to `items` and each sparse answer's
    KL(dense || sparse), all in the order of `items`."""
    if not items:
        raise ValueError("the golden set is empty; it needs at least one prompt")
    rows = [_row(item, d, s, kl) for item, d, s, kl in zip(items, dense, sparse, kls, strict=True)]
    interval = paired_bootstrap([row["dense_score"] - row["sparse_score"] for row in rows])
    return LevelDrift(
        level=level,
        calibration_version=calibration_version,
        metric="+".join(sorted({item.metric for item in items})),
        score_dense=math.fsum(row["dense_score"] for row in rows) / len(rows),
        score_sparse=math.fsum(row["sparse_score"] for row in rows) / len(rows),
        drift=interval.mean,
        drift_low=interval.low,
        drift_high=interval.high,
        kl_mean=math.fsum(kls) / len(kls),
        answers_changed=sum(1 for row in rows if row["changed"]),
        prompts=len(rows),
        details={"items": rows},
    )


def _row(item: GoldenItem, dense: str, sparse: str, kl: float) -> dict[str, Any]:
    return {
        "id": item.id,
        "metric": item.metric,
        "dense_score": score(item.metric, dense, item.reference),
        "sparse_score": score(item.metric, sparse, item.reference),
        "changed": dense != sparse,
        "kl": kl,
        "dense": dense[:PREVIEW_CHARS],
        "sparse": sparse[:PREVIEW_CHARS],
    }
