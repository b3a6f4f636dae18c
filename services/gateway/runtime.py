"""What a running gateway holds: settings, engine, worker, metrics, telemetry, upstream, the
control listener, the trust judge (replaced whole when a trust model arrives), and the job
clients that admin endpoints open on first use."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import httpx
from prometheus_client import CollectorRegistry

from services.config import Settings
from services.gateway.engine_thread import EngineWorker
from services.gateway.fallback import KnowledgeBase
from services.gateway.metrics import GatewayMetrics
from services.gateway.tracing import Tracing
from services.gateway.trust import TrustJudge, load_judge, reload_judge, serving_versions
from services.telemetry.schema import TelemetryEvent
from sparse_engine.runtime.engine import Engine
from sparse_engine.trust.model import TrustModel

if TYPE_CHECKING:
    from celery import Celery
    from sqlalchemy import Engine as SqlEngine
    from sqlalchemy.orm import Session, sessionmaker

    from services.gateway.control_listener import ControlListener

log = logging.getLogger(__name__)


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
    tracing: Tracing | None = None  # OTLP span export, when an endpoint is configured
    jobs: JobClients = field(init=False)
    trust: TrustJudge = field(init=False)
    knowledge: KnowledgeBase = field(init=False)
    arrived_trust: dict[str, TrustModel] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.jobs = JobClients(self.settings)
        self.trust = load_judge(self.settings, self.engine.lm.model_id)
        self.knowledge = KnowledgeBase(self.settings)

    def install_trust_model(self, model: TrustModel, reason: str) -> None:
        """Score the requests that start from now on with `model` (the control listener's
        thread calls this). One assignment swaps the judge, so each answer is judged wholly by
        the old judge or the new one, never by half of each."""
        before = serving_versions(self.trust)
        if model.version in before.values():
            return  # a message delivered again
        self.arrived_trust[model.version] = model
        arrived = list(self.arrived_trust.values())
        self.trust = reload_judge(self.settings, self.engine.lm.model_id, self.trust, arrived)
        log.info(
            "trust model of %s: %s -> %s (%s, %s)",
            self.engine.lm.model_id,
            before,
            serving_versions(self.trust),
            model.version,
            reason or "no reason given",
        )
