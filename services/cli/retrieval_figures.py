"""The figures of `sparseguard eval retrieval`: a policy's accuracy and share regenerated, what
decides its gain (fixes, breaks and how well a score ranks them), the closed-book baselines and
the gain a perfect detector would recover."""

from __future__ import annotations

import math
from typing import Any

from services.storage import kb as knowledge
from sparse_engine.evaluation.ranking import auroc
from sparse_engine.trust.evaluate import QARecord
from sparse_engine.trust.features import RequestSignals
from sparse_engine.trust.report import BASELINES

Answer = tuple[bool, float]  # right, trust score


def policy(first: list[Answer], second: list[Answer], threshold: float) -> dict[str, Any]:
    """Accuracy of the first answers, of the second ones, and of taking the second only where
    the first's trust is under `threshold`; the share of the gain that recovers, and the curve
    over every threshold (share regenerated, accuracy)."""
    n = len(first)
    base = sum(r for r, _ in first) / n
    everywhere = sum(r for r, _ in second) / n
    chosen = [b if s < threshold else a for (a, s), (b, _) in zip(first, second, strict=True)]
    regenerated = sum(s < threshold for _, s in first) / n
    on_low = sum(chosen) / n
    gain = everywhere - base
    order = sorted(range(n), key=lambda i: first[i][1])  # least trusted first
    curve, right = [(0.0, round(base, 4))], sum(r for r, _ in first)
    for taken, i in enumerate(order, 1):
        right += second[i][0] - first[i][0]
        curve.append((round(taken / n, 4), round(right / n, 4)))
    return {
        "never": round(base, 4),
        "always": round(everywhere, 4),
        "on_low_trust": round(on_low, 4),
        "regenerated": round(regenerated, 4),
        "gain_recovered": round((on_low - base) / gain, 4) if gain > 0 else None,
        "curve": curve,
    }


def perfect_detector(first: list[Answer], second: list[Answer], budget: float) -> float | None:
    """The share of the gain a perfect detector of right first answers would recover within
    `budget` (expected): it keeps every right answer, so nothing breaks, and retries wrong ones
    in an order blind to which of them retrieval fixes."""
    wrong = sum(not a for a, _ in first)
    fixed = sum(b and not a for (a, _), (b, _) in zip(first, second, strict=True))
    gain = sum(b for b, _ in second) - sum(a for a, _ in first)
    if gain <= 0 or wrong == 0:
        return None
    return round(fixed * min(1.0, budget * len(first) / wrong) / gain, 4)


def top_rank(found: list[knowledge.Hit]) -> float:
    return found[0].rank if found else -math.inf


def fixes(first: list[Answer], second: list[Answer], match: list[float]) -> dict[str, Any]:
    """What decides the gain: how many answers retrieval fixes and breaks, and how well each
    signal known before regenerating ranks them (AUROC): the trust score for a right
    closed-book answer (the answers a policy should keep), low trust and the best passage's
    search rank for a fix."""
    fixed = [b and not a for (a, _), (b, _) in zip(first, second, strict=True)]
    scores = [s for _, s in first]
    return {
        "fixes": sum(fixed),
        "breaks": sum(a and not b for (a, _), (b, _) in zip(first, second, strict=True)),
        "trust_auroc_right": rounded(auroc(scores, [a for a, _ in first])),
        "low_trust_auroc_fix": rounded(auroc([-s for s in scores], fixed)),
        "match_auroc_fix": rounded(auroc(match, fixed)),
    }


def baselines(answers: list[Answer], signals: list[RequestSignals]) -> dict[str, float | None]:
    """AUROC for a right closed-book answer of each baseline a detector must beat, in its
    better direction (the passage is not in the prompt, so containment does not apply)."""
    right = [r for r, _ in answers]
    records = [
        QARecord(i, "", False, 0.0, r, sig)
        for i, (r, sig) in enumerate(zip(right, signals, strict=True))
    ]
    out: dict[str, float | None] = {}
    for name, read in BASELINES.items():
        if name != "in_passage":
            a = auroc(list(map(read, records)), right)
            out[name] = None if math.isnan(a) else round(max(a, 1 - a), 4)
    return out


def rounded(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 4)
