"""End to end: telemetry with low sparsity -> aggregator windows -> alert rule fires -> alert
history and a queued recalibration job in SQL -> signed Alertmanager-v4 webhook delivered to a
real receiver on loopback, which verifies the Standard Webhooks signature."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, HTTPException, Request
from prometheus_client import CollectorRegistry
from pydantic import SecretStr
from sqlalchemy import select

from alerts.signing import SignatureError, verify
from services.aggregator.alert_loop import AlertLoop
from services.aggregator.loop import Aggregator
from services.aggregator.metrics import AggregatorMetrics
from services.alerting.webhooks import WebhookDispatcher
from services.config import AlertSettings, WebhookReceiver
from services.shared.serving import serve
from services.storage.db import make_engine, session_factory
from services.storage.models import AlertRecord, JobRun
from services.telemetry.broker import Broker
from tests.aggregator_fixtures import event, pipeline_settings, produce, running
from tests.polling import wait_until

SECRET = "whsec_" + base64.b64encode(b"sparseguard-test-secret-key-32by").decode()
RULES = """
rules:
  - name: SparsityBelowTarget
    metric: sparsity_mean
    window: 5m
    op: "<"
    threshold: {relative_to: sparsity_target, factor: 1.0, default: 0.60}
    min_requests: 1
    for: 0s
    severity: warning
    annotations:
      summary: "Sparsity below target on {{ $labels.model }}"
    actions: [webhook, recalibrate]
"""


@pytest.fixture
def receiver() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    received: list[dict[str, Any]] = []
    app = FastAPI()

    @app.post("/hook")
    async def hook(request: Request) -> dict[str, str]:
        body = await request.body()
        try:
            verify(SECRET, dict(request.headers), body, datetime.now(UTC))
        except SignatureError as exc:
            raise HTTPException(401, str(exc)) from None
        received.append(await request.json())
        return {"status": "ok"}

    with serve(app) as url:
        yield f"{url}/hook", received


def test_low_sparsity_fires_alert_queues_job_and_delivers_signed_webhook(
    kafka_broker: Broker, tmp_path: Path, receiver: tuple[str, list[dict[str, Any]]]
) -> None:
    url, received = receiver
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    settings = pipeline_settings(tmp_path, kafka_broker.bootstrap, partitions=1)
    alerts = AlertSettings(
        rules_file=rules, receivers=[WebhookReceiver(name="ops", url=url, secret=SecretStr(SECRET))]
    )
    settings = settings.model_copy(update={"alerts": alerts})
    sessions = session_factory(make_engine(settings.database_url))
    registry = CollectorRegistry()
    aggregator = Aggregator(
        settings,
        sessions,
        AggregatorMetrics(registry),
        alerting=AlertLoop(alerts, sessions, registry),
    )
    events = [event("m1", "balanced", sparsity_ratio=0.2) for _ in range(5)]
    produce(settings, events)
    with running(aggregator):
        wait_until(lambda: aggregator.folded == 5)
        assert aggregator.evaluate_alerts() == 1
    with sessions() as session:
        history = session.scalars(select(AlertRecord)).all()
        jobs = session.scalars(select(JobRun)).all()
    assert [(a.name, a.state) for a in history] == [("SparsityBelowTarget", "firing")]
    assert history[0].annotations["summary"] == "Sparsity below target on m1"
    # The alert leads to the requests behind it, and its job runs in the latest one's trace.
    latest = [e.trace_id for e in reversed(events)]
    assert history[0].annotations["trace_ids"] == ",".join(latest)
    assert jobs[0].trace_id == latest[0]
    assert [(j.kind, j.status, j.reason) for j in jobs] == [
        ("recalibrate", "queued", "alert:SparsityBelowTarget")
    ]

    async def deliver() -> int:
        async with httpx.AsyncClient() as client:
            return await WebhookDispatcher(alerts, sessions, client, registry).deliver_due()

    assert asyncio.run(deliver()) == 1
    (payload,) = received
    assert payload["version"] == "4" and payload["status"] == "firing"
    assert payload["alerts"][0]["labels"]["alertname"] == "SparsityBelowTarget"
    assert payload["alerts"][0]["labels"]["model"] == "m1"
    assert (
        registry.get_sample_value("sparseguard_alert_actions_total", {"action": "recalibrate"})
        == 1.0
    )
    delivered = registry.get_sample_value(
        "sparseguard_webhook_deliveries_total", {"receiver": "ops", "outcome": "delivered"}
    )
    assert delivered == 1.0
