"""What a running gateway holds: settings, engine, worker, metrics, telemetry, upstream."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import httpx
from prometheus_client import CollectorRegistry

from services.config import Settings
from services.gateway.metrics import GatewayMetrics
from services.gateway.worker import EngineWorker
from services.telemetry.schema import TelemetryEvent
from sparse_engine.engine import Engine


class TelemetrySink(Protocol):
    def send(self, event: TelemetryEvent) -> None: ...


@dataclass(slots=True)
class Runtime:
    settings: Settings
    engine: Engine
    worker: EngineWorker
    metrics: GatewayMetrics
    registry: CollectorRegistry
    sink: TelemetrySink | None = None
    upstream: httpx.AsyncClient | None = None
