"""The golden-set drift check as a job: run dense and each sparse level over the golden set,
store one run per level, and act. A level over the per-check budget (signals.drift_budget_bleu,
BLEU points) raises the GoldenDriftHigh alert (the aggregator evaluates the stored runs); a 24 h
average over signals.drift_recalibrate_bleu queues a recalibration of that level and raises the
model's fine-tune flag."""

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
from services.workers.golden_set import load_golden
from services.workers.jobs import ClaimedJob
from sparse_engine.sparsity.plan import Level

log = logging.getLogger(__name__)
DAY = timedelta(hours=24)


def golden_check(
    settings: Settings, sessions: sessionmaker[Session], celery: Celery, job: ClaimedJob
) -> dict[str, Any]:
    engine = build_engine(settings, job.params.get("model"))  # the decode path the gateway serves
    if settings.jobs.golden_set is not None:
        path = settings.golden_set_path
    else:
        path = golden.ensure_default_golden(settings, engine)
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
        "levels": by_level,
    }


def record(
    session: Session,
    settings: Settings,
    model_id: str,
    results: list[golden.LevelDrift],
    job: ClaimedJob,
    now: datetime,
) -> dict[str, dict[str, Any]]:
    """Store the runs; a level whose 24 h mean drift is over the limit raises the fine-tune flag
    and gets a recalibration job (returned as `recalibration_job`, to be sent after the
    commit) unless one was queued for it in the last 24 h. Returns the figures per level."""
    golden.store_runs(session, model_id, results, now)
    by_level: dict[str, dict[str, Any]] = {}
    for result in results:
        average = golden.drift_average(session, model_id, result.level, now - DAY)
        figures: dict[str, Any] = {
            "drift_bleu": round(result.drift_bleu, 3),
            "drift_bleu_24h": None if average is None else round(average, 3),
            "kl_mean": round(result.kl_mean, 4),
            "answers_changed": result.answers_changed,
            "over_budget": result.over_budget(settings.signals.drift_budget_bleu),
        }
        if average is not None and average > settings.signals.drift_recalibrate_bleu:
            details = {"level": result.level, "drift_bleu_24h": average, "golden_job": job.id}
            set_flag(session, model_id, "finetune", "golden-drift", details)
            reason = f"golden-drift:{result.level}"
            earlier = jobs.recent_job(session, "recalibrate", reason, now - DAY)
            if earlier is not None:  # one drift recalibration a day per level is enough
                figures["recalibration_job_earlier"] = earlier
            else:
                params = {"level": result.level, "model": job.params.get("model")}
                made = jobs.create_job(session, "recalibrate", reason, params, job.trace_id)
                figures["recalibration_job"] = made.id
        by_level[result.level] = figures
    return by_level
