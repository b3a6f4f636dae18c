"""The golden-set drift check as a job: run dense and each sparse level over the golden set,
store one run per level, and act. A level whose drift interval lies above the per-check budget
(its lower bound over signals.drift_budget, in points of the per-item metric) is `over-budget`
and raises the GoldenDriftHigh alert (the aggregator evaluates the stored runs); a 24 h mean of
the lower bounds over signals.drift_recalibrate queues a recalibration of that level and raises
the model's fine-tune flag. Keying both on the lower bound means a small golden set's noise
alone never recalibrates: only drift the set can tell from zero does."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from typing import Any

from celery import Celery
from sqlalchemy.orm import Session, sessionmaker
from tqdm import tqdm

from services.config import Settings
from services.shared.engine import build_engine
from services.storage.repository import set_flag
from services.workers import golden, jobs
from services.workers.golden_score import LevelDrift
from services.workers.golden_set import load_golden
from services.workers.jobs import ClaimedJob
from sparse_engine.sparsity.plan import Level

log = logging.getLogger(__name__)
DAY = timedelta(hours=24)


def golden_check(
    settings: Settings, sessions: sessionmaker[Session], celery: Celery, job: ClaimedJob
) -> dict[str, Any]:
    engine = build_engine(settings, job.params.get("model"))  # the decode path the gateway serves
    path = golden.ensure_default_golden(settings)  # a configured set must exist already
    items = load_golden(path)
    levels = [Level.parse(name) for name in job.params.get("levels") or settings.jobs.golden_levels]
    max_new_tokens = int(job.params.get("max_new_tokens") or settings.jobs.golden_max_new_tokens)
    total = len(items) * (1 + len(golden.runnable_levels(engine, levels)))
    with tqdm(total=total, desc="golden-set check", unit="answer", mininterval=10) as bar:
        results = golden.check(engine, items, levels, max_new_tokens, bar.update)
    if not results:
        raise ValueError("no sparse level is calibrated; run `sparseguard calibrate --level all`")
    with sessions.begin() as session:
        by_level = record(session, settings, engine.lm.model_id, results, job, datetime.now(UTC))
    for level, figures in by_level.items():
        log.info("golden check %s: %s", level, figures)
        if "recalibration_job" in figures:
            jobs.dispatch(celery, figures["recalibration_job"], "recalibrate")
    fast_path = engine.fast.dtype if engine.fast is not None else "off"
    return {
        "golden_set": str(path),
        "prompts": len(items),
        "fast_path": fast_path,
        "budget": settings.signals.drift_budget,
        "levels": by_level,
    }


def record(
    session: Session,
    settings: Settings,
    model_id: str,
    results: list[LevelDrift],
    job: ClaimedJob,
    now: datetime,
) -> dict[str, dict[str, Any]]:
    """Store the runs; a level whose 24 h mean interval lower bound is over the limit raises
    the fine-tune flag and gets a recalibration job (returned as `recalibration_job`, to be
    sent after the commit) unless one was queued for it in the last 24 h. Returns the figures
    per level."""
    signals = settings.signals
    golden.store_runs(session, model_id, results, now, signals.drift_budget)
    by_level: dict[str, dict[str, Any]] = {}
    for result in results:
        average = golden.drift_low_average(session, model_id, result.level, now - DAY)
        figures = _figures(result, average, signals.drift_budget)
        if average is not None and average > signals.drift_recalibrate:
            figures.update(_recalibrate(session, model_id, result.level, average, job, now))
        by_level[result.level] = figures
    return by_level


def _figures(result: LevelDrift, low_24h: float | None, budget: float) -> dict[str, Any]:
    return {
        **result.figures(budget),
        "drift_low_24h": None if low_24h is None else round(low_24h, 3),
    }


def _recalibrate(
    session: Session, model_id: str, level: str, low_24h: float, job: ClaimedJob, now: datetime
) -> dict[str, int]:
    details = {"level": level, "drift_low_24h": low_24h, "golden_job": job.id}
    set_flag(session, model_id, "finetune", "golden-drift", details)
    reason = f"golden-drift:{level}"
    earlier = jobs.recent_job(session, "recalibrate", reason, now - DAY)
    if earlier is not None:  # one drift recalibration a day per level is enough
        return {"recalibration_job_earlier": earlier}
    params = {"level": level, "model": job.params.get("model")}
    return {
        "recalibration_job": jobs.create_job(
            session, "recalibrate", reason, params, job.trace_id
        ).id
    }
