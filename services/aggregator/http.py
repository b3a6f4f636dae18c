"""The aggregator's HTTP side: /metrics (window gauges refreshed on scrape), /windows (the
current windows as JSON) and /healthz."""

from __future__ import annotations

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.aggregator.loop import Aggregator


def create_http_app(aggregator: Aggregator) -> FastAPI:
    app = FastAPI(title="SparseGuard aggregator", version="1")

    @app.get("/metrics")
    async def metrics() -> Response:
        aggregator.metrics.set_windows(aggregator.snapshot())
        body = generate_latest(aggregator.metrics.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/windows")
    async def current_windows() -> dict[str, object]:
        keys = aggregator.snapshot()
        return {
            "partitions": sorted(aggregator.owned),
            "events_folded": aggregator.folded,
            "keys": [
                {
                    "model": model,
                    "level": level,
                    "windows": {w: s.to_dict() for w, s in by_window.items()},
                }
                for (model, level), by_window in sorted(keys.items())
            ],
        }

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app
