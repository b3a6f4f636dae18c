"""What a running gateway holds: settings, engine, worker, metrics, telemetry, upstream, the
control listener, and the job clients that admin endpoints open on first use."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import httpx
from prometheus_client import CollectorRegistry

from services.config import Settings
from services.gateway.engine_thread import EngineWorker
from services.gateway.fallback import KnowledgeBase
from services.gateway.metrics import GatewayMetrics
from services.gateway.trust import TrustJudge, load_judge
from services.telemetry.schema import TelemetryEvent
from sparse_engine.runtime.engine import Engine

if TYPE_CHECKING:
    from celery import Celery
    from sqlalchemy import Engine as SqlEngine
    from sqlalchemy.orm import Session, sessionmaker

    from services.gateway.calibration_listener import ControlListener


class TelemetrySink(Protocol):
    def send(self, event: TelemetryEvent) -> None: ...


class JobClients:
    """The job table's sessions and the Celery client. Made on first use (migrating the
    database then), since most gateways never queue a job; thread-safe."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._lock = threading.Lock()
        self._opened: tuple[SqlEngine, sessionmaker[Session], Celery] | None = None

    def open(self) -> tuple[sessionmaker[Session], Celery]:
        with self._lock:
            if self._opened is None:
                self._opened = _connect(self._settings)
            _, sessions, celery = self._opened
            return sessions, celery

    def close(self) -> None:
        with self._lock:
            if self._opened is not None:
                engine, _, celery = self._opened
                celery.close()
                engine.dispose()
                self._opened = None


def _connect(settings: Settings) -> tuple[SqlEngine, sessionmaker[Session], Celery]:
    from services.storage.db import make_engine, session_factory, upgrade
    from services.workers.app import make_celery

    upgrade(settings.database_url)
    engine = make_engine(settings.database_url)
    return engine, session_factory(engine), make_celery(settings)


@dataclass(slots=True)
class Runtime:
    settings: Settings
    engine: Engine
    worker: EngineWorker
    metrics: GatewayMetrics
    registry: CollectorRegistry
    sink: TelemetrySink | None = None
    upstream: httpx.AsyncClient | None = None
    control: ControlListener | None = None
    jobs: JobClients = field(init=False)
    trust: TrustJudge = field(init=False)
    knowledge: KnowledgeBase = field(init=False)

    def __post_init__(self) -> None:
        self.jobs = JobClients(self.settings)
        self.trust = load_judge(self.settings, self.engine.lm.model_id)
        self.knowledge = KnowledgeBase(self.settings)
