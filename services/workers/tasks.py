"""The Celery tasks. Each is thin: take a job id, claim the job (a finished one is skipped, so a
redelivered task is harmless), call a plain function, record the outcome. Transient failures
retry with exponential back-off; bad input fails the job at once."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from datetime import UTC, datetime
from functools import cached_property
from typing import Any

from celery import Celery, Task
from celery.exceptions import SoftTimeLimitExceeded
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from services.config import Settings
from services.storage.db import make_engine, session_factory
from services.storage.models import JobRun
from services.workers import jobs
from services.workers.app import make_celery
from services.workers.jobs import ClaimedJob
from services.workers.names import NIGHTLY_GOLDEN, REDISPATCH, SCHEDULED_RECALIBRATION, TASKS

log = logging.getLogger(__name__)
PERMANENT = (ValueError, LookupError)  # bad parameters, nothing calibrated: retrying won't help
Work = Callable[[ClaimedJob], dict[str, Any]]


class Context:
    """What the tasks share in a worker process, made on first use (after the fork)."""

    def __init__(self, app: Celery, settings: Settings) -> None:
        self.app = app
        self.settings = settings

    @cached_property
    def sessions(self) -> sessionmaker[Session]:
        return session_factory(make_engine(self.settings.database_url))


def register_tasks(app: Celery, settings: Settings) -> None:
    ctx = Context(app, settings)
    cfg = settings.jobs
    retries = cfg.max_retries

    def job_task(kind: str, limit_s: int, work: Callable[[], Work]) -> None:
        """Register the task that runs jobs of `kind`; `work()` imports the job's function
        (in the worker, on first use) and binds it to this worker's settings."""

        @app.task(
            name=TASKS[kind],
            bind=True,
            max_retries=retries,
            soft_time_limit=limit_s,
            time_limit=limit_s + 60,
        )
        def run(task: Task[Any, Any], job_id: int) -> None:
            run_job(task, ctx, job_id, work())

    def recalibrate() -> Work:
        from services.workers.recalibration import recalibrate

        return lambda job: recalibrate(settings, ctx.sessions, job)

    def golden_check() -> Work:
        from services.workers.drift import golden_check

        return lambda job: golden_check(settings, ctx.sessions, app, job)

    def trust_fit() -> Work:
        from services.workers.trust_fit import fit_trust

        return lambda job: fit_trust(settings, job)

    def baseline() -> Work:
        from services.workers.baseline_job import measure_baselines

        return lambda job: measure_baselines(settings, ctx.sessions, job)

    job_task("recalibrate", cfg.recalibrate_time_limit_s, recalibrate)
    job_task("golden_check", cfg.golden_time_limit_s, golden_check)
    # Answering a few hundred QA items, or the baseline pass, takes minutes: bounded like a
    # recalibration.
    job_task("trust_fit", cfg.recalibrate_time_limit_s, trust_fit)
    job_task("baseline", cfg.recalibrate_time_limit_s, baseline)

    @app.task(name=NIGHTLY_GOLDEN, bind=True, max_retries=retries)
    def golden_nightly(task: Task[Any, Any]) -> None:
        schedule_once(ctx, "golden_check", {})

    @app.task(name=SCHEDULED_RECALIBRATION, bind=True, max_retries=retries)
    def recalibrate_scheduled(task: Task[Any, Any]) -> None:
        schedule_once(ctx, "recalibrate", {"level": settings.engine.default_level})

    @app.task(name=REDISPATCH, bind=True, max_retries=retries)
    def redispatch(task: Task[Any, Any]) -> None:
        sent = jobs.redispatch_stale(ctx.sessions, app, cfg.redispatch_after_s)
        if sent:
            log.warning("sent again %d queued jobs whose message was lost: %s", len(sent), sent)


def run_job(task: Task[Any, Any], ctx: Context, job_id: int, work: Work) -> None:
    job = jobs.claim(ctx.sessions, job_id)
    if job is None:
        log.info("job %d has already finished; nothing to do", job_id)
        return
    log.info("job %d (%s, %s): attempt %d", job.id, job.kind, job.reason, job.attempts)
    try:
        result = work(job)
    except SoftTimeLimitExceeded:
        jobs.fail(ctx.sessions, job_id, "time limit exceeded")
        log.error("job %d exceeded its time limit", job_id)
        return
    except PERMANENT as exc:
        jobs.fail(ctx.sessions, job_id, str(exc))
        log.error("job %d failed: %s", job_id, exc)
        return
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        if task.request.retries >= (task.max_retries or 0):
            jobs.fail(ctx.sessions, job_id, error)
            log.exception("job %d failed after %d retries", job_id, task.request.retries)
            return
        jobs.requeue(ctx.sessions, job_id, error)
        delay = backoff(task.request.retries, ctx.settings.jobs.retry_backoff_max_s)
        log.warning("job %d: %s; retrying in %.0f s", job_id, error, delay)
        raise task.retry(exc=exc, countdown=delay) from exc
    jobs.finish(ctx.sessions, job_id, result)
    log.info("job %d succeeded: %s", job_id, result)


def backoff(retries: int, cap_s: float) -> float:
    """Exponential back-off with full jitter: up to 10 s, 20 s, 40 s, ... capped."""
    return random.uniform(1.0, min(cap_s, 10.0 * 2**retries))


def schedule_once(ctx: Context, kind: str, params: dict[str, Any]) -> int | None:
    """Store and send a scheduled job unless one for this kind already exists for today's
    UTC date (a beat tick delivered twice makes one job)."""
    now = datetime.now(UTC)
    midnight = now.replace(hour=0, minute=0, second=0, microsecond=0)
    with ctx.sessions.begin() as session:
        existing = session.scalar(
            select(JobRun.id).where(
                JobRun.kind == kind, JobRun.reason == "schedule", JobRun.created_at >= midnight
            )
        )
        if existing is not None:
            log.info("scheduled %s for %s already exists: job %d", kind, midnight.date(), existing)
            return None
        job_id = jobs.create_job(session, kind, "schedule", {**params, "slot": str(now.date())}).id
    jobs.dispatch(ctx.app, job_id, kind)
    return job_id


def worker_app(settings: Settings) -> Celery:
    """The app with the task bodies registered (imports torch and the engine)."""
    app = make_celery(settings)
    register_tasks(app, settings)
    return app
