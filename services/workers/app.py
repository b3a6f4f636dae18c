"""The Celery app, built from the one settings object. Clients (gateway, aggregator, CLI) send
tasks by name with `make_celery`; only the worker registers the task bodies (`tasks.worker_app`)."""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery.schedules import crontab

from services.config import JobSettings, Settings
from services.workers.names import NIGHTLY_GOLDEN, REDISPATCH, SCHEDULED_RECALIBRATION


def make_celery(settings: Settings) -> Celery:
    app = Celery("sparseguard", broker=settings.celery_broker_url, set_as_current=False)
    app.conf.update(
        task_default_queue=settings.jobs.queue,
        task_serializer="json",
        accept_content=["json"],
        # Our job table is the record of results; Celery keeps none.
        task_ignore_result=True,
        # A task is acknowledged after it ran, so a worker that dies mid-task leaves the
        # message to be delivered again; the job table makes a second run a no-op.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        broker_transport_options=transport_options(settings),
        timezone="UTC",
        enable_utc=True,
        beat_schedule=beat_schedule(settings.jobs),
    )
    return app


def is_redis(settings: Settings) -> bool:
    return settings.celery_broker_url.startswith(("redis://", "rediss://"))


def transport_options(settings: Settings) -> dict[str, Any]:
    if not is_redis(settings):
        return {}  # the SQLAlchemy transport hands these to create_engine
    visibility = settings.jobs.visibility_timeout_s
    return {
        "visibility_timeout": visibility,
        # Look for abandoned tasks often enough for the visibility timeout to be what counts.
        "unacked_restore_interval": max(1, min(10, int(visibility / 4))),
        "unacked_restore_throttle": 1,
    }


def beat_schedule(jobs: JobSettings) -> dict[str, dict[str, Any]]:
    schedule: dict[str, dict[str, Any]] = {
        "golden-check-nightly": {"task": NIGHTLY_GOLDEN, "schedule": cron(jobs.golden_cron)},
        "redispatch-queued-jobs": {"task": REDISPATCH, "schedule": jobs.redispatch_interval_s},
    }
    if jobs.recalibrate_cron:
        schedule["recalibrate-scheduled"] = {
            "task": SCHEDULED_RECALIBRATION,
            "schedule": cron(jobs.recalibrate_cron),
        }
    return schedule


def cron(expression: str) -> crontab:
    """A five-field cron expression ("minute hour day-of-month month day-of-week"), in UTC."""
    fields = expression.split()
    if len(fields) != 5:
        raise ValueError(
            f"cron expression {expression!r} needs 5 fields "
            "(minute hour day-of-month month day-of-week), e.g. '0 3 * * *'"
        )
    minute, hour, day_of_month, month_of_year, day_of_week = fields
    try:
        return crontab(minute, hour, day_of_week, day_of_month, month_of_year)
    except ValueError as exc:
        raise ValueError(f"cron expression {expression!r}: {exc}") from None
