"""A gateway on loopback around the tiny engine, with telemetry recorded in memory."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from services.config import GatewaySettings, Settings, TelemetrySettings
from services.gateway.app import create_app
from services.shared.serving import serve
from services.telemetry.schema import TelemetryEvent
from sparse_engine.runtime.engine import Engine, GenerationRequest
from sparse_engine.runtime.generation import GenerationStats
from sparse_engine.runtime.sequence import Sequence
from sparse_engine.sparsity.plan import SparsityPlan


class RecordingSink:
    """Keeps the events in memory (the Kafka path is tested against a real broker)."""

    def __init__(self) -> None:
        self.events: list[TelemetryEvent] = []

    def send(self, event: TelemetryEvent) -> None:
        self.events.append(event)

    def by_trace(self, trace_id: str) -> TelemetryEvent:
        return next(e for e in self.events if e.trace_id == trace_id)


class GatedEngine(Engine):
    """The real engine, held at the start of each generation until `gate` is set, and
    optionally slowed down per forward pass (the tiny model is too fast to race against).
    `finished` holds every generation's statistics, in the order they ended."""

    def __init__(self, inner: Engine, token_delay_s: float = 0.0, open_gate: bool = False) -> None:
        super().__init__(inner.lm, inner.plans, inner.prefix_cache)
        self.fast, self.fast_prefixes = inner.fast, inner.fast_prefixes
        self.gate = threading.Event()
        self.token_delay_s = token_delay_s
        self.finished: list[GenerationStats] = []
        self.entered = 0
        if open_gate:
            self.gate.set()

    def start(
        self, request: GenerationRequest, plan: SparsityPlan, cancelled: threading.Event
    ) -> Sequence:
        self.entered += 1
        self.gate.wait(30)
        return super().start(request, plan, cancelled)

    def passes(self, seq: Sequence) -> ExitStack:
        time.sleep(self.token_delay_s)
        return super().passes(seq)

    def finish(
        self, seq: Sequence, drift: float | None = None, ended: float | None = None
    ) -> GenerationStats:
        stats = super().finish(seq, drift, ended)
        self.finished.append(stats)
        return stats


def settings_for(home: Path, **gateway: Any) -> Settings:
    return Settings(
        home=home,
        gateway=GatewaySettings(**gateway),
        telemetry=TelemetrySettings(enabled=False),
    )


@contextmanager
def running_gateway(settings: Settings, engine: Engine, sink: RecordingSink) -> Iterator[str]:
    with serve(create_app(settings, engine=engine, sink=sink)) as url:
        yield url
