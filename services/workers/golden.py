"""The golden-set drift check as plain functions: the default golden set written on first use
(external references only, `golden_default`), frozen dense answers for sets an operator
builds, the check itself (dense and each sparse level's answers scored per item,
see `golden_score`), and the rows it stores.

Drift is the mean over items of score(dense) - score(sparse), in points (0-100), per level."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from services.config import Settings
from services.storage.models import GoldenRun
from services.workers import golden_default
from services.workers.golden_score import LevelDrift, summarize
from services.workers.golden_set import SHORT_METRIC, GoldenItem, write_golden
from sparse_engine.runtime.engine import Engine
from sparse_engine.runtime.generation import GenerationRequest, GenerationStats
from sparse_engine.runtime.offline import generate_all
from sparse_engine.sparsity.plan import Level, SparsityPlan

log = logging.getLogger(__name__)

Progress = Callable[[int], None]
# A short-answer item ("Answer in a few words") never needs more tokens than this; capping it
# keeps the check affordable when the model rambles past the answer.
SHORT_ANSWER_TOKENS = 24

# --- building references ---------------------------------------------------------------------


def _request(prompt: str, max_new_tokens: int, measure_drift: bool = False) -> GenerationRequest:
    return GenerationRequest(
        messages=[{"role": "user", "content": prompt}],
        max_new_tokens=max_new_tokens,
        temperature=0.0,
        measure_drift=measure_drift,
        collect_signals=False,
        use_prefix_cache=False,
    )


def freeze(
    engine: Engine,
    prompts: Sequence[tuple[str, str]],
    max_new_tokens: int,
    progress: Progress | None = None,
) -> list[GoldenItem]:
    """Golden items whose references are the dense model's greedy answers (for a set an
    operator builds from their own prompts; the default set uses external references)."""
    source = f"dense:{engine.lm.model_id}"
    jobs = [(_request(prompt, max_new_tokens), Level.DENSE) for _, prompt in prompts]
    found = generate_all(engine, jobs, progress=progress)
    return [
        GoldenItem(pid, prompt, stats.text, source)
        for (pid, prompt), stats in zip(prompts, found, strict=True)
    ]


def ensure_default_golden(settings: Settings) -> Path:
    """The golden-set path, built from the packaged data first when it is the default and
    missing."""
    path = settings.golden_set_path
    if path.is_file():
        return path
    if settings.jobs.golden_set is not None:
        raise FileNotFoundError(
            f"golden set {path} not found; create it with `sparseguard golden create "
            f"--prompts FILE --out {path}` or unset jobs.golden_set to use the default set"
        )
    log.info("building the default golden set (MT-Bench and HaluEval) at %s", path)
    write_golden(path, golden_default.default_golden(settings.cache_home))
    return path


# --- the check -----------------------------------------------------------------------------------


def runnable_levels(engine: Engine, levels: Iterable[str]) -> list[Level]:
    """The sparse levels among `levels` that the engine has a calibration for."""
    runnable: list[Level] = []
    for level in map(Level.parse, levels):
        if level is Level.DENSE:
            continue  # the baseline every level is compared with
        if level not in engine.plans:
            log.info(
                "golden check skips %s: no calibration for %s", level.value, engine.lm.model_id
            )
            continue
        runnable.append(level)
    return runnable


def check(
    engine: Engine,
    items: Sequence[GoldenItem],
    levels: Iterable[str],
    max_new_tokens: int,
    progress: Progress | None = None,
) -> list[LevelDrift]:
    """Dense answers once, then each calibrated sparse level's answers and KL, compared.
    `progress(1)` follows each generation: len(items) * (1 + runnable levels) in all."""
    plans = {level.value: engine.plans[level] for level in runnable_levels(engine, levels)}
    return compare(engine, items, plans, max_new_tokens, progress)


def compare(
    engine: Engine,
    items: Sequence[GoldenItem],
    plans: Mapping[str, SparsityPlan],
    max_new_tokens: int,
    progress: Progress | None = None,
) -> list[LevelDrift]:
    """`check` for any named plans (a level's, or one made for a measurement: the dense plan
    against itself, a plan scaled to a sparsity), each run pinned as it is given."""
    if not items:
        raise ValueError("the golden set is empty; it needs at least one prompt")
    _warn_dense_references(items, engine.lm.model_id)
    started = time.perf_counter()
    dense = [s.text for s in _answers(engine, items, Level.DENSE, max_new_tokens, progress)]
    timing = {"dense_seconds": round(time.perf_counter() - started, 1)}
    results = []
    for name, plan in plans.items():
        started = time.perf_counter()
        sparse = _answers(engine, items, plan, max_new_tokens, progress)
        kls = [s.semantic_drift_kl or 0.0 for s in sparse]  # always set when measured
        texts = [s.text for s in sparse]
        version = plan.calibration_version or "unversioned"
        result = summarize(name, version, items, dense, texts, kls)
        result.details.update(timing, seconds=round(time.perf_counter() - started, 1))
        results.append(result)
        log.info(
            "golden check %s: drift %.2f points [%.2f, %.2f], %d of %d answers changed",
            name,
            result.drift,
            result.drift_low,
            result.drift_high,
            result.answers_changed,
            result.prompts,
        )
    return results


def answer_tokens(item: GoldenItem, max_new_tokens: int) -> int:
    """The answer budget of one item: short answers are capped at SHORT_ANSWER_TOKENS."""
    return (
        min(max_new_tokens, SHORT_ANSWER_TOKENS) if item.metric == SHORT_METRIC else max_new_tokens
    )


def _answers(
    engine: Engine,
    items: Sequence[GoldenItem],
    level: Level | SparsityPlan,
    max_new_tokens: int,
    progress: Progress | None,
) -> list[GenerationStats]:
    """Every item's answer, batched as served (`runtime.offline`): the same items make the
    same batches under every plan."""
    drift = level is not Level.DENSE
    jobs = [(_request(i.prompt, answer_tokens(i, max_new_tokens), drift), level) for i in items]
    return generate_all(engine, jobs, progress=progress)


def _warn_dense_references(items: Sequence[GoldenItem], model_id: str) -> None:
    frozen = {i.source for i in items if i.source.startswith("dense:")}
    if not frozen:
        return
    foreign = frozen - {f"dense:{model_id}"}
    log.warning(
        "%d golden references are dense-model answers%s: they score agreement with a model, "
        "not answer quality; the default set (unset jobs.golden_set) has external references",
        sum(1 for i in items if i.source in frozen),
        f", frozen from another model ({', '.join(sorted(foreign))})" if foreign else "",
    )


# --- storage (plain functions of a Session; they never commit) -----------------------------------


def store_runs(
    session: Session,
    model_id: str,
    results: Sequence[LevelDrift],
    created_at: datetime,
    budget: float,
) -> list[GoldenRun]:
    """One row per level, with its status against `budget` (signals.drift_budget)."""
    runs = [
        GoldenRun(model_id=model_id, created_at=created_at, status=r.status(budget), **asdict(r))
        for r in results
    ]
    session.add_all(runs)
    session.flush()
    return runs


def drift_low_average(session: Session, model_id: str, level: str, since: datetime) -> float | None:
    """Mean interval lower bound of the level's runs with `created_at >= since`; None if there
    are none (runs stored before the interval existed have none and are left out)."""
    value = session.scalar(
        select(func.avg(GoldenRun.drift_low)).where(
            GoldenRun.model_id == model_id,
            GoldenRun.level == level,
            GoldenRun.created_at >= since,
        )
    )
    return None if value is None else float(value)


def last_run_at(session: Session, model_id: str | None = None) -> datetime | None:
    """When the latest golden run (of this model, when given) was stored."""
    statement = select(func.max(GoldenRun.created_at))
    if model_id is not None:
        statement = statement.where(GoldenRun.model_id == model_id)
    return session.scalar(statement)
