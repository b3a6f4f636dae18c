"""Operator endpoints (admin key): GET /admin/status, POST /admin/recalibrate (queues a
recalibration job) and GET /admin/jobs/{job_id} (follows it)."""

from __future__ import annotations

import dataclasses
from typing import Annotated

from fastapi import APIRouter, Path, Request
from pydantic import BaseModel, ConfigDict, Field

from services.gateway.deps import AdminDep, RuntimeDep
from services.gateway.errors import ApiError
from services.gateway.tracing import TraceParent
from services.gateway.trust import at_chance_versions, serving_versions
from services.storage.models import JobRun
from services.workers.jobs import JobView, submit
from sparse_engine.sparsity.plan import SPARSE_LEVELS, Level

router = APIRouter(prefix="/admin")
JobId = Annotated[int, Path(ge=1, le=2**63 - 1)]  # a database integer


class RecalibrateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    level: str = Field(max_length=32)
    model: str | None = Field(None, max_length=256)


class JobQueued(BaseModel):
    job_id: int
    status: str


@router.get("/status")
async def admin_status(rt: RuntimeDep, _: AdminDep) -> dict[str, object]:
    """Operator view: calibration per level, queue, prefix cache, telemetry, control, trust."""
    cache = rt.engine.prefix_cache
    stats = getattr(rt.sink, "stats", None)
    return {
        "model": rt.engine.lm.model_id,
        "mode": rt.settings.gateway.mode,
        "levels": {
            level.value: plan.calibration_version for level, plan in rt.engine.plans.items()
        },
        "queue_depth": rt.worker.depth,
        "prefix_cache": {
            "entries": len(cache) if cache else 0,
            "mismatches": cache.mismatches if cache else 0,
        },
        "telemetry": dataclasses.asdict(stats()) if callable(stats) else None,
        "control_listener": rt.control.ready.is_set() if rt.control else None,
        # None: no trust model yet, the rule score (1 - late-layer silence) is served.
        "trust_models": serving_versions(rt.trust),
        # Served models whose low scores are reported only (`trust.act_on_chance`).
        "trust_at_chance": [] if rt.settings.trust.act_on_chance else at_chance_versions(rt.trust),
    }


# Plain `def` handlers: the job table and the broker are blocking clients, run in a thread.
@router.post("/recalibrate", status_code=202)
def recalibrate(
    body: RecalibrateRequest, rt: RuntimeDep, _: AdminDep, request: Request
) -> JobQueued:
    """Queue a recalibration of `level` (this gateway's model unless `model` is given); the
    new version reaches every gateway on the control topic once the job has made it. The job
    runs in the caller's trace (an incoming `traceparent`), or in a new one."""
    level = _sparse_level(body.level)
    params = {"level": level.value, "model": body.model or rt.settings.engine.model}
    sessions, celery = rt.jobs.open()
    trace_id = (TraceParent.parse(request.headers) or TraceParent.new()).trace_id
    job_id = submit(sessions, celery, "recalibrate", "operator", params, trace_id=trace_id)
    return JobQueued(job_id=job_id, status="queued")


@router.get("/jobs/{job_id}")
def job(job_id: JobId, rt: RuntimeDep, _: AdminDep) -> JobView:
    sessions, _celery = rt.jobs.open()
    with sessions() as session:
        row = session.get(JobRun, job_id)
        if row is None:
            raise ApiError(404, f"no job {job_id}; POST /admin/recalibrate returns the job id")
        return JobView.model_validate(row)


def _sparse_level(name: str) -> Level:
    choices = ", ".join(level.value for level in SPARSE_LEVELS)
    try:
        level = Level.parse(name)
    except ValueError:
        raise ApiError(400, f"unknown level '{name}'; choose one of: {choices}") from None
    if level not in SPARSE_LEVELS:
        raise ApiError(400, f"the dense level has no calibration; choose one of: {choices}")
    return level
