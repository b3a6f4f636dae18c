"""`sparseguard aggregator`: migrate, create topics, serve HTTP, run the loop until stopped."""

from __future__ import annotations

import logging
import signal
import threading

from prometheus_client import CollectorRegistry

from services.aggregator.http import create_http_app
from services.aggregator.loop import Aggregator
from services.aggregator.metrics import AggregatorMetrics
from services.config import Settings
from services.serving import serve
from services.storage.db import make_engine, session_factory, upgrade
from services.telemetry.topics import ensure_topics, topic_specs

log = logging.getLogger(__name__)


def build_aggregator(settings: Settings) -> Aggregator:
    upgrade(settings.database_url)
    ensure_topics(settings.telemetry.bootstrap_servers, topic_specs(settings.telemetry))
    sessions = session_factory(make_engine(settings.database_url))
    return Aggregator(settings, sessions, AggregatorMetrics(CollectorRegistry()))


def run_aggregator(settings: Settings) -> None:
    aggregator = build_aggregator(settings)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    app = create_http_app(aggregator)
    cfg = settings.aggregator
    with serve(app, host=cfg.host, port=cfg.port) as url:
        log.info("aggregator HTTP on %s (metrics at /metrics, windows at /windows)", url)
        aggregator.run(stop)
