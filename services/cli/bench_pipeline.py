"""`sparseguard bench pipeline`: fold throughput (pure), aggregator throughput from the
real broker (embedded Tansu, SQLite, one aggregator), and event-to-fold latency."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kafka import KafkaProducer
from prometheus_client import CollectorRegistry

from services.aggregator.loop import Aggregator
from services.aggregator.metrics import AggregatorMetrics
from services.aggregator.synthetic import fold_throughput, synthetic_events
from services.cli.common import emit, emit_json
from services.config import AggregatorSettings, Settings, TelemetrySettings
from services.storage.db import make_engine, session_factory, upgrade
from services.telemetry.broker import Broker
from services.telemetry.schema import TelemetryEvent, to_record
from services.telemetry.topics import ensure_topics, topic_specs


def register(bench: Any) -> None:
    p = bench.add_parser("pipeline", help="fold and aggregator throughput, event-to-fold latency")
    p.add_argument("--events", type=int, default=5000, help="events for the throughput run")
    p.add_argument("--rate", type=float, default=200.0, help="events/s for the latency run")
    p.add_argument("--seconds", type=float, default=5.0, help="length of the latency run")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=run_pipeline_bench)


def run_pipeline_bench(args: argparse.Namespace, settings: Settings) -> int:
    report: dict[str, Any] = {"fold_events_per_s": round(fold_throughput(100_000))}
    broker = Broker()
    broker.start()
    try:
        with tempfile.TemporaryDirectory() as home:
            bench_settings = _settings(Path(home), broker.bootstrap)
            report |= _measure(bench_settings, args.events, args.rate, args.seconds)
    finally:
        broker.stop()
    if args.json:
        emit_json(report)
        return 0
    emit(f"fold (pure, 100k events):       {report['fold_events_per_s']:>10,} events/s")
    emit(
        f"aggregator from the broker:     {report['aggregator_events_per_s']:>10,.0f} events/s "
        f"({args.events} events, SQLite, one aggregator)"
    )
    emit(
        f"event-to-fold latency at {args.rate:g}/s: p50 {report['latency_ms']['p50']:.1f} ms, "
        f"p99 {report['latency_ms']['p99']:.1f} ms"
    )
    return 0


def _settings(home: Path, bootstrap: str) -> Settings:
    telemetry = TelemetrySettings(bootstrap_servers=bootstrap, partitions=1)
    settings = Settings(
        home=home, telemetry=telemetry, aggregator=AggregatorSettings(poll_timeout_ms=50)
    )
    upgrade(settings.database_url)
    ensure_topics(bootstrap, topic_specs(telemetry))
    return settings


def _measure(settings: Settings, count: int, rate: float, seconds: float) -> dict[str, Any]:
    producer = KafkaProducer(bootstrap_servers=settings.telemetry.bootstrap_servers, linger_ms=5)
    now = datetime.now(UTC)
    for e in synthetic_events(count):
        _send(producer, settings, e.model_copy(update={"time": now, "trace_id": uuid.uuid4().hex}))
    producer.flush(30)
    aggregator = Aggregator(
        settings,
        session_factory(make_engine(settings.database_url)),
        AggregatorMetrics(CollectorRegistry()),
    )
    stop = threading.Event()
    thread = threading.Thread(target=aggregator.run, args=(stop,), daemon=True)
    thread.start()
    _wait(lambda: bool(aggregator.owned), 60)  # joining the consumer group takes ~3 s
    started = time.perf_counter()
    _wait(lambda: aggregator.folded >= count, 300)
    throughput = count / (time.perf_counter() - started)
    aggregator.recent_latency_s.clear()
    template = synthetic_events(1)[0]
    for _ in range(int(rate * seconds)):
        _send(
            producer,
            settings,
            template.model_copy(update={"time": datetime.now(UTC), "trace_id": uuid.uuid4().hex}),
        )
        time.sleep(1 / rate)
    producer.flush(30)
    _wait(lambda: len(aggregator.recent_latency_s) >= int(rate * seconds), 60)
    stop.set()
    thread.join(30)
    producer.close()
    latencies = sorted(1000 * x for x in aggregator.recent_latency_s)
    p99 = latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))]
    return {
        "aggregator_events_per_s": round(throughput, 1),
        "latency_ms": {"p50": round(statistics.median(latencies), 1), "p99": round(p99, 1)},
    }


def _send(producer: KafkaProducer, settings: Settings, event: TelemetryEvent) -> None:
    key, value, headers = to_record(event)
    producer.send(settings.telemetry.topic, key=key, value=value, headers=headers)


def _wait(condition: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the aggregator did not keep up within the time limit")
        time.sleep(0.02)
