"""GET /v1/models, /healthz, /readyz, /metrics."""

from __future__ import annotations

import dataclasses
import time

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.gateway.deps import AdminDep, PrincipalDep, RuntimeDep

router = APIRouter()
STARTED = int(time.time())


@router.get("/v1/models")
async def models(rt: RuntimeDep, _: PrincipalDep) -> dict[str, object]:
    model = {
        "id": rt.engine.lm.model_id,
        "object": "model",
        "created": STARTED,
        "owned_by": "sparseguard",
    }
    return {"object": "list", "data": [model]}


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(rt: RuntimeDep) -> JSONResponse:
    checks = {"model_loaded": True, "broker_reachable": _broker_ok(rt)}
    ready = all(checks.values())
    return JSONResponse({"ready": ready, **checks}, status_code=200 if ready else 503)


@router.get("/metrics")
async def metrics(rt: RuntimeDep) -> Response:
    rt.metrics.queue_depth.set(rt.worker.depth)
    stats = getattr(rt.sink, "stats", None)
    if callable(stats):
        current = stats()
        rt.metrics.spool_bytes.set(current.spool_bytes)
        rt.metrics.dropped.set(current.dropped)
    return Response(generate_latest(rt.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/admin/status")
async def admin_status(rt: RuntimeDep, _: AdminDep) -> dict[str, object]:
    """Operator view: calibration per level, queue, prefix cache and telemetry state."""
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
    }


def _broker_ok(rt: RuntimeDep) -> bool:
    if rt.sink is None or not rt.settings.telemetry.enabled:
        return True
    stats = getattr(rt.sink, "stats", None)
    return bool(stats().connected) if callable(stats) else True
