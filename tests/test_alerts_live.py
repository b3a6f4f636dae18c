"""The alarms live, on the real stack: a gateway around the tiny engine, the broker, the
aggregator with its alert loop and webhook dispatcher, SQLite. Calibrations carry healthy
baselines measured on the engine; the default rules run with every `for` shortened to two
seconds (test settings). Healthy traffic for longer than every `for` raises no alert and
queues no recalibration; then the balanced level is miscalibrated (its thresholds scaled
up, same version) and GateConfidenceOutOfBand fires and is delivered as a webhook."""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import CollectorRegistry
from pydantic import SecretStr
from sqlalchemy import select

from alerts.rules import DEFAULT_RULES
from services.aggregator.alert_loop import AlertLoop
from services.aggregator.loop import Aggregator
from services.aggregator.metrics import AggregatorMetrics
from services.alerting.webhooks import WebhookDispatcher
from services.config import AlertSettings, EngineSettings, WebhookReceiver
from services.gateway.app import create_app
from services.shared.serving import serve
from services.storage.db import make_engine, session_factory
from services.storage.models import AlertRecord, JobRun
from services.storage.repository import calibration_row, upsert_calibration
from services.telemetry.broker import Broker
from sparse_engine.calibration.baseline import run_prompts, summarise
from sparse_engine.calibration.store import CalibrationStore
from sparse_engine.data.traffic import Prompt
from sparse_engine.runtime.engine import Engine
from sparse_engine.sparsity.plan import Level
from sparse_engine.sparsity.scaled import scale
from tests.aggregator_fixtures import pipeline_settings, running
from tests.polling import wait_until
from tests.test_alerting_pipeline import (
    SECRET,
    receiver,  # noqa: F401  (fixture)
)
from tests.tiny import calibration_of, tiny_engine

# The baseline and the live healthy traffic draw different numbers from one distribution (the
# same range, interleaved). The digits are tokens: with 1000-1119 against 0-39 (or 0-239
# against 0-79) the tiny model's per-layer sparsity differed by 6-11 standard errors and
# LayerSparsityShift fired, as it should on traffic unlike the baseline's.
BASELINE = [i for i in range(240) if i % 4 in (0, 1)]
LIVE = [i for i in range(240) if i % 12 in (2, 3)]
FAULTY = list(range(240, 320))
TOPICS = ("sparsity", "caching", "kernels", "drift", "alerts", "windows", "gates", "batches")


def prompts(numbers: list[int]) -> list[Prompt]:
    """Two kinds of short questions with these numbers."""
    found = []
    for i in numbers:
        topic = TOPICS[i % len(TOPICS)]
        if i % 2:
            found.append(Prompt("chat", f"Question {i}: what is {topic}?"))
        else:
            found.append(Prompt("qa", f"Passage {i} is about {topic}. What is it about?"))
    return found


def calibrate_with_baselines(engine: Engine, settings: Any, sessions: Any) -> None:
    """Store and register the tiny balanced plan as a calibration with its healthy baseline."""
    healthy = prompts(BASELINE)
    dense = run_prompts(engine, Level.DENSE, healthy, 8)
    answers = run_prompts(engine, Level.BALANCED, healthy, 8)
    cal = calibration_of(engine, "tiny-balanced")
    cal.baseline = summarise(Level.BALANCED, healthy, answers, 8).to_dict()
    cal.dense_baseline = summarise(Level.DENSE, healthy, dense, 8).to_dict()
    CalibrationStore(settings.calibrations_dir).save(cal)
    with sessions.begin() as session:
        upsert_calibration(session, calibration_row(cal, "cli"))


def fast_rules(tmp_path: Path) -> Path:
    """The default rules with every `for` at 2 s and a 10-request minimum."""
    text = DEFAULT_RULES.read_text(encoding="utf-8")
    text = re.sub(r"for: \d+m", "for: 2s", text)
    text = re.sub(r"min_requests: \d+", "min_requests: 10", text)
    path = tmp_path / "rules.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def send(client: httpx.Client, batch: list[Prompt]) -> None:
    for p in batch:
        body = {"messages": p.messages(), "max_tokens": 8, "ir_sparse_level": "balanced"}
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text


def test_healthy_traffic_raises_nothing_and_a_fault_fires_its_alert(
    kafka_broker: Broker,
    tmp_path: Path,
    receiver: tuple[str, list[dict[str, Any]]],  # noqa: F811
) -> None:
    url, received = receiver
    settings = pipeline_settings(tmp_path, kafka_broker.bootstrap, partitions=1)
    alerts = AlertSettings(
        rules_file=fast_rules(tmp_path),
        evaluation_interval_s=3600.0,  # evaluated when the test asks
        receivers=[WebhookReceiver(name="ops", url=url, secret=SecretStr(SECRET))],
    )
    settings = settings.model_copy(
        update={"alerts": alerts, "engine": EngineSettings(drift_sample_rate=1.0)}
    )
    sessions = session_factory(make_engine(settings.database_url))
    # With the prefix cache: a reused prefix reports the signals of an uncached prefill, so
    # the live requests (which reuse) read as the baseline pass's did.
    engine = tiny_engine()
    calibrate_with_baselines(engine, settings, sessions)
    registry = CollectorRegistry()
    alerting = AlertLoop(alerts, sessions, registry)
    aggregator = Aggregator(settings, sessions, AggregatorMetrics(registry), alerting=alerting)
    with (
        running(aggregator),
        serve(create_app(settings, engine=engine)) as gateway,
        httpx.Client(base_url=gateway, timeout=30) as client,
    ):
        send(client, prompts(LIVE))
        wait_until(lambda: aggregator.folded == 40)
        for _ in range(3):  # longer than every (shortened) `for`
            aggregator.evaluate_alerts()
            time.sleep(1.5)
        with sessions() as session:
            assert [(a.name, a.labels, a.value) for a in session.scalars(select(AlertRecord))] == []
            assert session.scalars(select(JobRun)).all() == []

        served = engine.plan(Level.BALANCED)
        broken = replace(scale(served, 6.0), calibration_version=served.calibration_version)
        engine.install(broken)
        send(client, prompts(FAULTY))
        wait_until(lambda: aggregator.folded == 120)
        for _ in range(3):
            aggregator.evaluate_alerts()
            time.sleep(1.5)
    with sessions() as session:
        fired = {(a.name, a.labels["level"], a.state) for a in session.scalars(select(AlertRecord))}
    assert ("GateConfidenceOutOfBand", "balanced", "firing") in fired

    async def deliver() -> int:
        async with httpx.AsyncClient() as client:
            return await WebhookDispatcher(alerts, sessions, client, registry).deliver_due()

    assert asyncio.run(deliver()) >= 1
    names = {a["labels"]["alertname"] for payload in received for a in payload["alerts"]}
    assert "GateConfidenceOutOfBand" in names
