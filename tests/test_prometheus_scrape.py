"""Every dashboard query returns data from a real Prometheus (the Debian binary) scraping a real
gateway and aggregator: tiny-engine traffic through a real broker, a golden-set check stored
for real, an alert that fires, raises the fine-tune flag and is delivered to a webhook, a
calibration reload over the control topic and a dead-lettered record. Prometheus also loads
the exported alert rules."""

from __future__ import annotations

import asyncio
import math
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kafka import KafkaProducer
from prometheus_client import CollectorRegistry
from pydantic import SecretStr
from sqlalchemy.orm import Session, sessionmaker

import dashboards
from alerts.prometheus import GROUP, export_prometheus
from alerts.rules import DEFAULT_RULES, load_rules
from services.aggregator.alert_loop import AlertLoop
from services.aggregator.http import create_http_app
from services.aggregator.loop import Aggregator
from services.aggregator.metrics import ALERT_SERIES, AggregatorMetrics
from services.alerting.webhooks import WebhookDispatcher
from services.config import Settings, WebhookReceiver
from services.gateway.app import create_app
from services.shared.serving import free_port, serve
from services.storage.db import make_engine, session_factory
from services.telemetry.broker import Broker
from services.telemetry.control import publish_calibration
from services.workers import drift, golden
from services.workers.golden_set import GoldenItem
from services.workers.jobs import ClaimedJob
from sparse_engine.runtime.engine import Engine
from tests.aggregator_fixtures import running
from tests.polling import wait_until
from tests.tiny import calibration_of, tiny_engine
from tests.traffic_fixtures import (
    LEVELS,
    register_healthy_calibrations,
    send_traffic,
    traffic_settings,
)
from tests.webhook_receiver import SECRETS, Clock, Receivers, Slot, receiver_app

PROMETHEUS = Path("/usr/bin/prometheus")
pytestmark = pytest.mark.skipif(
    not PROMETHEUS.exists(),
    reason=f"{PROMETHEUS} is missing: apt-get install prometheus (make tools) to run this test",
)

ROUNDS = 10  # requests per level, sent in two halves a few scrapes apart
GOLDEN = [
    GoldenItem("g1", "What is sparsity?", "Sparsity skips work that multiplies by zero.", "test"),
    GoldenItem("g2", "Name a colour.", "Blue.", "test"),
]
SCRAPE_INTERVAL_S = 1.0
QUERY_TIMEOUT_S = 30.0  # until every query has data (rates need two scrapes of a new series)


@contextmanager
def running_prometheus(tmp_path: Path, targets: dict[str, str]) -> Iterator[str]:
    """Prometheus scraping `targets` (job -> base URL) every second with the exported alert
    rules loaded; yields its URL once it is ready and every target is up. Always stopped."""
    rules = tmp_path / "sparseguard-rules.yaml"
    thresholds = Settings().signals.as_thresholds()
    rules.write_text(export_prometheus(load_rules(DEFAULT_RULES, thresholds), ALERT_SERIES))
    interval = f"{SCRAPE_INTERVAL_S:g}s"
    config = {
        "global": {
            "scrape_interval": interval,
            "scrape_timeout": interval,
            "evaluation_interval": interval,
        },
        "rule_files": [str(rules)],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": [url.removeprefix("http://")]}]}
            for job, url in targets.items()
        ],
    }
    config_file = tmp_path / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config))
    port = free_port()
    log_file = tmp_path / "prometheus.log"
    with log_file.open("wb") as log:
        process = subprocess.Popen(
            [
                str(PROMETHEUS),
                f"--config.file={config_file}",
                f"--storage.tsdb.path={tmp_path / 'prometheus-data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            try:
                wait_until(lambda: _ready(url, process), timeout_s=30, every_s=0.1)
                wait_until(lambda: _targets_up(url, set(targets)), timeout_s=30, every_s=0.1)
            except TimeoutError:
                tail = log_file.read_text(errors="replace")[-3000:]
                pytest.fail(f"Prometheus did not come up with all targets up:\n{tail}")
            yield url
        finally:
            process.terminate()
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(15)


def _ready(url: str, process: subprocess.Popen[bytes]) -> bool:
    if process.poll() is not None:
        raise RuntimeError(f"Prometheus exited with {process.returncode}")
    try:
        return httpx.get(f"{url}/-/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _targets_up(url: str, jobs: set[str]) -> bool:
    active = _api(url, "targets")["activeTargets"]
    return {t["labels"]["job"] for t in active if t["health"] == "up"} == jobs


def _api(url: str, path: str, **params: str) -> Any:
    response = httpx.get(f"{url}/api/v1/{path}", params=params, timeout=10)
    response.raise_for_status()
    body = response.json()
    assert body["status"] == "success", body
    return body["data"]


def query_values(url: str, promql: str) -> list[float]:
    """The values of an instant query (a vector's samples, or one scalar)."""
    data = _api(url, "query", query=promql)
    if data["resultType"] == "vector":
        return [float(sample["value"][1]) for sample in data["result"]]
    if data["resultType"] == "scalar":
        return [float(data["result"][1])]
    raise AssertionError(f"{promql}: unexpected result type {data['resultType']}")


def queries_without_data(url: str) -> list[str]:
    """Each dashboard query with no finite value (NaN-only counts as no data), described."""
    missing = []
    for uid, title, promql in dashboards.queries():
        values = query_values(url, promql)
        if not any(math.isfinite(v) for v in values):
            missing.append(f"{uid} / {title}: {promql} -> {values}")
    return missing


def _record_golden_check(
    sessions: sessionmaker[Session], settings: Settings, engine: Engine
) -> None:
    """A real golden-set check of the tiny engine, stored as the worker stores it."""
    results = golden.check(engine, GOLDEN, LEVELS, max_new_tokens=4)
    assert [r.level for r in results] == list(LEVELS)
    job = ClaimedJob(1, "golden_check", "schedule", {}, 1)
    with sessions.begin() as session:
        drift.record(session, settings, engine.lm.model_id, results, job, datetime.now(UTC))


def _send_malformed(settings: Settings) -> None:
    producer = KafkaProducer(bootstrap_servers=settings.telemetry.bootstrap_servers)
    try:
        producer.send(settings.telemetry.topic, value=b"{not a telemetry event").get(timeout=10)
    finally:
        producer.close(timeout=5)


def _deliver_webhooks(
    settings: Settings, sessions: sessionmaker[Session], registry: CollectorRegistry
) -> int:
    """Deliver the due notifications, counted on `registry` (the aggregator's /metrics)."""

    async def deliver() -> int:
        async with httpx.AsyncClient() as client:
            dispatcher = WebhookDispatcher(settings.alerts, sessions, client, registry)
            return await dispatcher.deliver_due()

    return asyncio.run(deliver())


def test_every_dashboard_query_has_data_in_a_real_prometheus(
    kafka_broker: Broker, tmp_path: Path
) -> None:
    hooks = Slot(Receivers(clock=Clock(datetime.now(UTC))))  # signatures checked against now
    with serve(receiver_app(hooks)) as hook_base:
        receiver = WebhookReceiver(
            name="ops", url=f"{hook_base}/hooks/ops", secret=SecretStr(SECRETS["ops"])
        )
        settings = traffic_settings(
            tmp_path, kafka_broker, ("webhook", "flag_finetune"), [receiver]
        )
        sessions = session_factory(make_engine(settings.database_url))
        registry = CollectorRegistry()
        alerting = AlertLoop(settings.alerts, sessions, registry)
        aggregator = Aggregator(settings, sessions, AggregatorMetrics(registry), alerting=alerting)
        engine = tiny_engine()
        # Baselines for the aggregator (their gauges have data); the gateway judges by the
        # published numbers, so the tiny model's answers still raise spikes and trust actions.
        register_healthy_calibrations(settings, engine, store=False)
        _record_golden_check(sessions, settings, engine)  # before the gateway shares the engine
        gateway_registry = CollectorRegistry()
        gateway = create_app(settings, engine=engine, registry=gateway_registry)
        with (
            running(aggregator),
            serve(create_http_app(aggregator)) as aggregator_url,
            serve(gateway) as gateway_url,
            running_prometheus(
                tmp_path, {"gateway": gateway_url, "aggregator": aggregator_url}
            ) as prometheus,
            httpx.Client(base_url=gateway_url, timeout=30) as client,
        ):
            # Two halves a few scrapes apart: the per-key histograms (created by the first
            # events) must grow between scrapes for histogram_quantile() to have data.
            half = ROUNDS // 2
            send_traffic(client, range(half))
            wait_until(lambda: aggregator.folded == half * len(LEVELS))
            time.sleep(3 * SCRAPE_INTERVAL_S)
            send_traffic(client, range(half, ROUNDS))
            wait_until(lambda: aggregator.folded == ROUNDS * len(LEVELS))

            control = gateway.state.runtime.control
            assert control is not None and control.ready.wait(30)
            publish_calibration(
                settings.telemetry, calibration_of(engine, "tiny-balanced-v2"), "test"
            )
            reloads = ("sparseguard_calibration_reloads_total", {"level": "balanced"})
            wait_until(lambda: gateway_registry.get_sample_value(*reloads) == 1.0)
            _send_malformed(settings)
            dead_letters = "sparseguard_events_dead_lettered_total"
            wait_until(lambda: registry.get_sample_value(dead_letters) == 1.0)

            aggregator.persist_snapshots()
            assert aggregator.evaluate_alerts() == 1  # fires, raises the flag, queues a notice
            assert _deliver_webhooks(settings, sessions, registry) == 1
            assert [hit.receiver for hit in hooks.current.hits] == ["ops"]
            aggregator.evaluate_alerts()  # exports the flag raised by the first evaluation

            deadline = time.monotonic() + QUERY_TIMEOUT_S
            while (missing := queries_without_data(prometheus)) and time.monotonic() < deadline:
                time.sleep(SCRAPE_INTERVAL_S / 2)
            groups = _api(prometheus, "rules")["groups"]
    assert not missing, f"{len(missing)} dashboard queries without data:\n" + "\n".join(missing)
    assert [g["name"] for g in groups] == [GROUP]
    assert {r["name"] for r in groups[0]["rules"]} >= {"GateConfidenceOutOfBand"}
