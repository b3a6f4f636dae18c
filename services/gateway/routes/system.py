"""GET /v1/models, /healthz, /readyz, /metrics (the admin views are in routes_admin)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.gateway.deps import PrincipalDep, RuntimeDep

router = APIRouter()
STARTED = int(time.time())


@router.get("/v1/models")
async def models(rt: RuntimeDep, _: PrincipalDep) -> dict[str, object]:
    model = {
        "id": rt.engine.lm.model_id,
        "object": "model",
        "created": STARTED,
        "owned_by": "sparseguard",
        "ir_sparse_levels": [level.value for level in rt.engine.plans],
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
    rt.metrics.running.set(rt.worker.running)
    stats = getattr(rt.sink, "stats", None)
    if callable(stats):
        current = stats()
        rt.metrics.spool_bytes.set(current.spool_bytes)
        rt.metrics.dropped.set(current.dropped)
    return Response(generate_latest(rt.registry), media_type=CONTENT_TYPE_LATEST)


def _broker_ok(rt: RuntimeDep) -> bool:
    if rt.sink is None or not rt.settings.telemetry.enabled:
        return True
    stats = getattr(rt.sink, "stats", None)
    return bool(stats().connected) if callable(stats) else True
