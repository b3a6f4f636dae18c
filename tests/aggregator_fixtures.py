"""Synthetic telemetry events and a running aggregator for the pipeline tests."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from kafka import KafkaProducer
from prometheus_client import CollectorRegistry
from sqlalchemy import func, select

from services.aggregator.loop import Aggregator
from services.aggregator.metrics import AggregatorMetrics
from services.config import AggregatorSettings, Settings, TelemetrySettings
from services.storage.db import make_engine, session_factory, upgrade
from services.storage.models import RequestSummary
from services.telemetry.schema import TelemetryEvent, to_record
from services.telemetry.topics import ensure_topics, topic_specs

KEYS = [("m1", "balanced"), ("m1", "conservative"), ("m2", "balanced"), ("m2", "aggressive")]


def event(model: str, level: str, seconds_ago: float = 1.0, **fields: Any) -> TelemetryEvent:
    values: dict[str, Any] = {
        "trace_id": uuid.uuid4().hex,
        "time": datetime.now(UTC) - timedelta(seconds=seconds_ago),
        "model": model,
        "calibration_version": f"{model}-{level}-v1",
        "level": level,
        "mode": "serve",
        "api": "openai",
        "status": "ok",
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "sparsity_ratio": 0.5,
        "gate_confidence": 0.85,
        "silence_rate_per_layer": [0.1, 0.2, 0.3],
        "total_ms": 120.0,
        "ttft_ms": 20.0,
    }
    return TelemetryEvent(**(values | fields))


def pipeline_settings(tmp_path: Path, bootstrap: str, partitions: int = 4) -> Settings:
    telemetry = TelemetrySettings(bootstrap_servers=bootstrap, partitions=partitions)
    settings = Settings(
        home=tmp_path,
        telemetry=telemetry,
        aggregator=AggregatorSettings(poll_timeout_ms=200, max_poll_records=50),
    )
    upgrade(settings.database_url)
    ensure_topics(bootstrap, topic_specs(telemetry))
    return settings


def produce(
    settings: Settings,
    events: list[TelemetryEvent],
    partition_of: Callable[[TelemetryEvent], int] | None = None,
) -> None:
    """Send events as the gateway does; `partition_of` pins each key to a partition so the
    tests know which member owns what."""
    producer = KafkaProducer(bootstrap_servers=settings.telemetry.bootstrap_servers)
    for e in events:
        key, value, headers = to_record(e)
        partition = partition_of(e) if partition_of else None
        producer.send(
            settings.telemetry.topic, key=key, value=value, headers=headers, partition=partition
        )
    producer.flush(10)
    producer.close()


def key_partition(e: TelemetryEvent) -> int:
    return KEYS.index((e.model, e.level))


def new_aggregator(
    settings: Settings, after_persist: Callable[[], None] | None = None
) -> Aggregator:
    sessions = session_factory(make_engine(settings.database_url))
    return Aggregator(settings, sessions, AggregatorMetrics(CollectorRegistry()), after_persist)


@contextmanager
def running(aggregator: Aggregator) -> Iterator[threading.Thread]:
    stop = threading.Event()
    errors: list[BaseException] = []

    def target() -> None:
        try:
            aggregator.run(stop)
        except BaseException as exc:  # a test may crash it on purpose
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        stop.set()
        thread.join(30)


def stored(settings: Settings) -> int:
    engine = make_engine(settings.database_url)
    try:
        with session_factory(engine)() as session:
            return session.scalar(select(func.count()).select_from(RequestSummary)) or 0
    finally:
        engine.dispose()


def window_requests(aggregator: Aggregator, window: str = "5m") -> int:
    return sum(by_window[window].requests for by_window in aggregator.snapshot().values())
