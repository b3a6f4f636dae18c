"""Where a trust score becomes a flag: below the score that a budgeted share of healthy answers
fall under, measured per healthy kind (chat, QA, code, prose prompts the fit never saw), so a
model fit on QA items cannot flag every chat answer, nor every prose continuation (a chat
threshold flagged 90 % of them, README). A request is judged against the kinds of its own
category, and flagged only below all of theirs. Scores are reported as they are; only the
action follows this threshold."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence

from sparse_engine.calibration.baseline import kind_categories
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
) -> dict[str, list[RequestSignals]]:
    """The trust signals of greedy answers to healthy prompts, by kind, measured as the gateway
    does: generated (serve and closed mode), or generated, then scored teacher-forced as proxy
    mode scores an upstream's answer."""
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
    found: dict[str, list[RequestSignals]] = {}
    for (prompt, _), stats in zip(runnable, answers, strict=True):
        if mode == "proxy":
            try:
                stats = score_answer(engine, prompt.messages(), stats.text, level, True, True)
            except ValueError as exc:  # prompt and answer past the model's context
                log.info("healthy answer skipped: %s", exc)
                continue
        found.setdefault(prompt.kind, []).append(from_stats(stats, prompt.text))
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


def set_flag_thresholds(
    model: TrustModel,
    healthy: Mapping[str, Sequence[RequestSignals]],
    budget: float,
    level: str,
    prompts: Sequence[Prompt] = (),
    confidence: float = 0.0,
) -> dict[str, list[float]]:
    """Score each kind's healthy answers at `level`, store each kind's budgeted threshold in
    `model` (none for a kind with too few answers to spend the budget), and each kind's
    category from its `prompts`; return the scores by kind. With `confidence`, the threshold
    holds the budget with that probability over the sample (`tolerance_floor`), else on
    average (`conformal_floor`). The level's `flag_thresholds` entry, for a request whose
    category no kind has, is the lowest of the kinds'."""
    scores = {kind: [model.score(s) for s in signals] for kind, signals in healthy.items()}
    floors = {
        kind: tolerance_floor(kind_scores, budget, confidence)
        if confidence > 0
        else conformal_floor(kind_scores, budget)
        for kind, kind_scores in scores.items()
    }
    kept = {kind: floor for kind, floor in floors.items() if not math.isinf(floor)}
    model.kind_thresholds[level] = kept
    model.flag_categories.update(kind_categories(prompts))
    model.flag_thresholds.pop(level, None)
    if kept:
        model.flag_thresholds[level] = min(kept.values())
    model.flag_fit[level] = {
        "kinds": {
            kind: {
                "requests": len(kind_scores),
                "flagged_in_sample": sum(s < floors[kind] for s in kind_scores),
                "score_median": sorted(kind_scores)[len(kind_scores) // 2] if kind_scores else None,
            }
            for kind, kind_scores in scores.items()
        },
        "budget": budget,
        "confidence": confidence,
    }
    return scores


def flag_threshold(model: TrustModel, level: str, category: str | None = None) -> float | None:
    """The score under which an answer at `level` to a request of `category` is flagged: the
    lowest threshold among the kinds of that category (a request flagged against each of
    them), of every kind for a category none has; a model fit before kinds: its one threshold
    for the level. None where the level has none."""
    by_kind = model.kind_thresholds.get(level)
    if not by_kind:
        return model.flag_thresholds.get(level)
    own = [t for kind, t in by_kind.items() if model.flag_categories.get(kind) == category]
    return min(own or by_kind.values())
