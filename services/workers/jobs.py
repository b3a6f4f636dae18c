"""The job table is the record of every background job and the outbox of its task message:
a job is stored first, then its task is sent; a message that was lost is sent again by the
beat's redispatch sweep. A task claims its job before working, so a second delivery of a job
that already finished does nothing."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from celery import Celery
from pydantic import BaseModel, ConfigDict
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from services.storage.models import JobRun
from services.workers.names import TASKS

log = logging.getLogger(__name__)
FINISHED = ("succeeded", "failed")


class JobView(BaseModel):
    """A job as the admin endpoint and the CLI show it."""

    model_config = ConfigDict(from_attributes=True)
    id: int
    kind: str
    status: str
    reason: str
    params: dict[str, Any]
    result: dict[str, Any] | None
    trace_id: str | None
    attempts: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class JobNotFoundError(LookupError):
    """No job has this id."""


@dataclass(frozen=True, slots=True)
class ClaimedJob:
    id: int
    kind: str
    reason: str
    params: dict[str, Any]
    attempts: int
    trace_id: str | None = None


def create_job(
    session: Session,
    kind: str,
    reason: str,
    params: dict[str, Any],
    trace_id: str | None = None,
) -> JobRun:
    if kind not in TASKS:
        raise ValueError(f"unknown job kind {kind!r}; one of {', '.join(TASKS)}")
    job = JobRun(kind=kind, status="queued", reason=reason, params=params, trace_id=trace_id)
    session.add(job)
    session.flush()
    return job


def dispatch(celery: Celery, job_id: int, kind: str) -> bool:
    """Send the job's task; False when the broker cannot take it now (the job stays queued
    and the redispatch sweep sends it later)."""
    try:
        celery.send_task(TASKS[kind], args=[job_id], retry=False)
    except Exception as exc:  # the broker is down or unreachable
        log.warning("could not send job %d (%s) to the broker, will retry: %s", job_id, kind, exc)
        return False
    return True


def submit(
    sessions: sessionmaker[Session],
    celery: Celery,
    kind: str,
    reason: str,
    params: dict[str, Any],
    trace_id: str | None = None,
) -> int:
    """Store a job and send its task; returns the job id."""
    with sessions.begin() as session:
        job_id = create_job(session, kind, reason, params, trace_id).id
    dispatch(celery, job_id, kind)
    return job_id


def claim(sessions: sessionmaker[Session], job_id: int) -> ClaimedJob | None:
    """Mark the job running and return it; None when it has already finished."""
    with sessions.begin() as session:
        job = session.get(JobRun, job_id, with_for_update=True)
        if job is None:
            raise JobNotFoundError(f"no job {job_id}")
        if job.status in FINISHED:
            return None
        job.status = "running"
        job.attempts += 1
        job.started_at = datetime.now(UTC)
        return ClaimedJob(
            job.id, job.kind, job.reason, dict(job.params), job.attempts, job.trace_id
        )


def finish(sessions: sessionmaker[Session], job_id: int, result: dict[str, Any]) -> None:
    _close(sessions, job_id, "succeeded", result)


def fail(sessions: sessionmaker[Session], job_id: int, error: str) -> None:
    _close(sessions, job_id, "failed", {"error": error})


def requeue(sessions: sessionmaker[Session], job_id: int, error: str) -> None:
    """A retry is scheduled: back to queued, with the error that caused it."""
    with sessions.begin() as session:
        job = session.get(JobRun, job_id)
        if job is not None and job.status not in FINISHED:
            job.status = "queued"
            job.result = {"last_error": error}


def _close(
    sessions: sessionmaker[Session], job_id: int, status: str, result: dict[str, Any]
) -> None:
    with sessions.begin() as session:
        job = session.get(JobRun, job_id)
        if job is None:
            raise JobNotFoundError(f"no job {job_id}")
        job.status = status
        job.result = result
        job.finished_at = datetime.now(UTC)


def redispatch_stale(
    sessions: sessionmaker[Session], celery: Celery, older_than_s: float
) -> list[int]:
    """Send again the jobs queued for longer than `older_than_s` that no worker started."""
    cutoff = datetime.now(UTC) - timedelta(seconds=older_than_s)
    with sessions() as session:
        stale = session.execute(
            select(JobRun.id, JobRun.kind).where(
                JobRun.status == "queued",
                JobRun.started_at.is_(None),
                JobRun.created_at < cutoff,
            )
        ).all()
    return [job_id for job_id, kind in stale if dispatch(celery, job_id, kind)]


def recent_job(session: Session, kind: str, reason: str, since: datetime) -> int | None:
    """The newest job of `kind` with exactly this `reason` created since `since`."""
    return session.scalar(
        select(JobRun.id)
        .where(JobRun.kind == kind, JobRun.reason == reason, JobRun.created_at >= since)
        .order_by(JobRun.id.desc())
        .limit(1)
    )


def recent_jobs(session: Session, limit: int = 20, kind: str | None = None) -> list[JobRun]:
    statement = select(JobRun).order_by(JobRun.id.desc()).limit(limit)
    if kind is not None:
        statement = statement.where(JobRun.kind == kind)
    return list(session.scalars(statement))
