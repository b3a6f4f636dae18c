"""Where a trust score becomes a flag: below the score that a budgeted share of healthy answers
fall under, measured on healthy traffic of the route (chat prompts the fit never saw), so a
model fit on QA items cannot flag every chat answer. Scores are reported as they are; only the
action follows this threshold."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

from sparse_engine.calibration.conformal import confident_rank
from sparse_engine.data.traffic import Prompt
from sparse_engine.runtime.engine import Engine
from sparse_engine.runtime.generation import GenerationRequest
from sparse_engine.runtime.offline import generate_all
from sparse_engine.runtime.scoring import score_answer
from sparse_engine.sparsity.plan import Level
from sparse_engine.trust.features import RequestSignals, from_stats
from sparse_engine.trust.model import TrustModel

log = logging.getLogger(__name__)


def healthy_signals(
    engine: Engine,
    level: Level,
    prompts: Sequence[Prompt],
    max_new_tokens: int,
    progress: Callable[[int], object] | None = None,
    mode: str = "serve",
) -> list[RequestSignals]:
    """The trust signals of greedy answers to healthy prompts, measured as the gateway does:
    generated (serve and closed mode), or generated, then scored teacher-forced as proxy mode
    scores an upstream's answer."""
    runnable = []
    for prompt in prompts:
        request = GenerationRequest(
            messages=prompt.messages(),
            max_new_tokens=max_new_tokens,
            measure_drift=True,
            readout=mode != "proxy",
        )
        try:
            engine.check_length(len(engine.encode(request)[0]), max_new_tokens)
        except ValueError as exc:  # a prompt longer than the model's context: not its traffic
            log.info("healthy prompt skipped: %s", exc)
            continue
        runnable.append((prompt, request))
    jobs = [(request, level) for _, request in runnable]
    answers = generate_all(engine, jobs, progress=progress)  # batched
    found = []
    for (prompt, _), stats in zip(runnable, answers, strict=True):
        if mode == "proxy":
            try:
                stats = score_answer(engine, prompt.messages(), stats.text, level, True, True)
            except ValueError as exc:  # prompt and answer past the model's context
                log.info("healthy answer skipped: %s", exc)
                continue
        found.append(from_stats(stats, prompt.text))
    return found


def conformal_floor(scores: Sequence[float], budget: float) -> float:
    """The threshold t such that `score < t` flags exactly the scores whose conformal p-value
    (1 + #{healthy <= score}) / (n + 1) is at most `budget`: at most that share of healthy
    answers exchangeable with `scores`. -inf (never flag) when too few scores to spend it."""
    ordered = sorted(scores)
    allowed = math.floor(budget * (len(ordered) + 1)) - 1  # healthy scores at or under a flag
    return -math.inf if allowed < 0 else ordered[allowed]


def conformal_ceiling(values: Sequence[float], budget: float) -> float:
    """The mirror of `conformal_floor`: `value > t` holds for at most `budget` of healthy
    values (inf when too few to spend it)."""
    return -conformal_floor([-v for v in values], budget)


def tolerance_floor(scores: Sequence[float], budget: float, confidence: float) -> float:
    """A threshold t such that, with probability `confidence` over the sample, `score < t`
    holds for at most `budget` of the answers exchangeable with `scores` (conformal_floor
    holds it only on average, so half the time the realised share is over): the k-th smallest
    score for the largest k with P(Binomial(n, budget) >= k) >= confidence, since the share
    under the k-th smallest of n is Beta(k, n + 1 - k). -inf when the sample is too small."""
    ordered = sorted(scores)
    k = confident_rank(len(ordered), budget, confidence)
    return -math.inf if k == 0 else ordered[k - 1]


def set_flag_threshold(
    model: TrustModel, healthy: Sequence[RequestSignals], budget: float, route: str, level: str
) -> list[float]:
    """Score the healthy answers at `level`, store the budgeted threshold for that level in
    `model` (none when too few answers to spend the budget), return the scores."""
    scores = [model.score(s) for s in healthy]
    floor = conformal_floor(scores, budget)
    model.flag_thresholds.pop(level, None)
    if not math.isinf(floor):
        model.flag_thresholds[level] = floor
    flagged = sum(s < floor for s in scores)
    model.flag_fit[level] = {
        "route": route,
        "requests": len(scores),
        "budget": budget,
        "flagged_in_sample": flagged,
        "score_median": sorted(scores)[len(scores) // 2] if scores else None,
    }
    return scores
