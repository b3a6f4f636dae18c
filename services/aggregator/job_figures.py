"""Job figures for alerts and Prometheus, read from SQL: the age of the last golden-set check (a
missed night fires GoldenCheckMissed), each level's latest golden drift with its interval and
status and the 24 h mean of its lower bound (GoldenDriftHigh reads the latest lower bound), job
runs by kind and status, and standing model flags. Runs stored before the interval existed
(corpus BLEU, another unit) are left out."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from alerts.samples import Sample, pipeline_sample
from services.aggregator.metrics import AggregatorMetrics
from services.storage.models import GOLDEN_STATUSES, JOB_STATUSES, GoldenRun
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
    samples.extend(_golden_samples(session, now, metrics))
    counts = job_counts(session)
    for kind in TASKS:
        for status in JOB_STATUSES:
            metrics.gauge("job_runs").labels(kind, status).set(counts.get((kind, status), 0))
    metrics.gauge("model_flag").clear()  # a cleared flag disappears
    for flag in flags(session):
        metrics.gauge("model_flag").labels(flag.model_id, flag.flag).set(1)
    return samples


def _golden_samples(session: Session, now: datetime, metrics: AggregatorMetrics) -> list[Sample]:
    latest: dict[tuple[str, str], GoldenRun] = {}
    lows: dict[tuple[str, str], list[float]] = {}
    for run in golden_runs_since(session, now - DAY):  # oldest first
        if run.drift_low is None:
            continue
        key = (run.model_id, run.level)
        latest[key] = run
        lows.setdefault(key, []).append(run.drift_low)
    samples = []
    for (model, level), run in latest.items():
        labels = (model, level)
        metrics.gauge("golden_drift_points").labels(*labels).set(run.drift)
        metrics.gauge("golden_drift_low_points").labels(*labels).set(_known(run.drift_low))
        metrics.gauge("golden_drift_high_points").labels(*labels).set(_known(run.drift_high))
        day = lows[(model, level)]
        metrics.gauge("golden_drift_low_24h_points").labels(*labels).set(sum(day) / len(day))
        for status in GOLDEN_STATUSES:
            metrics.gauge("golden_drift_status").labels(*labels, status).set(run.status == status)
        samples.append(pipeline_sample("golden_drift", run.drift, model=model, level=level))
        samples.append(pipeline_sample("golden_drift_low", run.drift_low, model=model, level=level))
    return samples


def _known(value: float | None) -> float:
    return float("nan") if value is None else value
