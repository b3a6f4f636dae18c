"""`sparseguard aggregator`: migrate, create topics, serve HTTP, run the loop until stopped."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading

import httpx
from prometheus_client import CollectorRegistry

from services.aggregator.alert_loop import AlertLoop
from services.aggregator.http import create_http_app
from services.aggregator.loop import Aggregator
from services.aggregator.metrics import AggregatorMetrics
from services.alerting.webhooks import WebhookDispatcher
from services.config import Settings
from services.shared.serving import serve
from services.storage.db import make_engine, session_factory, upgrade
from services.telemetry.topics import ensure_topics, topic_specs
from services.workers.app import make_celery

log = logging.getLogger(__name__)


def build_aggregator(settings: Settings) -> Aggregator:
    upgrade(settings.database_url)
    ensure_topics(settings.telemetry.bootstrap_servers, topic_specs(settings.telemetry))
    sessions = session_factory(make_engine(settings.database_url))
    registry = CollectorRegistry()
    url = f"http://{settings.aggregator.host}:{settings.aggregator.port}"
    celery = make_celery(settings)
    alerting = AlertLoop(
        settings.alerts,
        sessions,
        registry,
        external_url=url,
        celery=celery,
        signals=settings.signals,
    )
    return Aggregator(settings, sessions, AggregatorMetrics(registry), alerting=alerting)


def run_aggregator(settings: Settings) -> None:
    aggregator = build_aggregator(settings)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    app = create_http_app(aggregator)
    cfg = settings.aggregator
    webhooks = threading.Thread(target=deliver_webhooks, args=(aggregator, stop), daemon=True)
    with serve(app, host=cfg.host, port=cfg.port) as url:
        log.info("aggregator HTTP on %s (metrics at /metrics, windows at /windows)", url)
        webhooks.start()
        aggregator.run(stop)
    webhooks.join(10)


def deliver_webhooks(
    aggregator: Aggregator, stop: threading.Event, interval_s: float = 1.0
) -> None:
    """Drain the webhook outbox until `stop` (in its own thread and event loop)."""

    async def loop() -> None:
        async with httpx.AsyncClient() as client:
            dispatcher = WebhookDispatcher(
                aggregator.settings.alerts, aggregator.sessions, client, aggregator.metrics.registry
            )
            while not stop.is_set():
                try:
                    await dispatcher.deliver_due()
                except Exception:
                    log.exception("webhook delivery round failed; retrying")
                await asyncio.sleep(interval_s)

    asyncio.run(loop())
