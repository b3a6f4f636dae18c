"""Job figures for alerts and Prometheus, read from SQL: the age of the last golden-set check (a
missed night fires GoldenCheckMissed), each level's latest golden drift and its 24 h mean, job
runs by kind and status, and standing model flags."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from alerts.samples import Sample, pipeline_sample
from services.aggregator.metrics import AggregatorMetrics
from services.storage.models import JOB_STATUSES
from services.storage.repository import (
    first_calibration_at,
    flags,
    golden_runs_since,
    job_counts,
    last_golden_run_at,
)
from services.workers.names import TASKS

DAY = timedelta(hours=24)


def job_samples(session: Session, now: datetime, metrics: AggregatorMetrics) -> list[Sample]:
    """Samples for the evaluator; also sets the golden and fine-tune-flag gauges."""
    # Before the first check, the age counts from the first calibration: a system that has
    # served for over a day without a check has missed one.
    since = last_golden_run_at(session) or first_calibration_at(session)
    age = None if since is None else max(0.0, (now - since).total_seconds())
    samples = [pipeline_sample("golden_check_age_s", age, component="golden")]
    if age is not None:
        metrics.gauge("golden_check_age_seconds").set(age)
    latest: dict[tuple[str, str], float] = {}
    day: dict[tuple[str, str], list[float]] = {}
    for run in golden_runs_since(session, now - DAY):
        key = (run.model_id, run.level)
        latest[key] = run.drift_bleu
        day.setdefault(key, []).append(run.drift_bleu)
    for (model, level), drift in latest.items():
        mean = sum(day[(model, level)]) / len(day[(model, level)])
        metrics.gauge("golden_drift_bleu_points").labels(model, level).set(drift)
        metrics.gauge("golden_drift_bleu_24h_points").labels(model, level).set(mean)
        samples.append(pipeline_sample("golden_drift_bleu", drift, model=model, level=level))
    counts = job_counts(session)
    for kind in TASKS:
        for status in JOB_STATUSES:
            metrics.gauge("job_runs").labels(kind, status).set(counts.get((kind, status), 0))
    metrics.gauge("model_flag").clear()  # a cleared flag disappears
    for flag in flags(session):
        metrics.gauge("model_flag").labels(flag.model_id, flag.flag).set(1)
    return samples
