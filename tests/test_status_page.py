"""The gateway's status page: /status/data on an empty database and behind admin keys, and end
to end in headless Chromium after real traffic (gateway -> real broker -> aggregator -> SQL ->
page), asserting on what the page rendered."""

from __future__ import annotations

import json
import logging
import struct
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy.orm import Session, sessionmaker

from services.aggregator.alerting import AlertLoop
from services.aggregator.loop import Aggregator
from services.aggregator.metrics import AggregatorMetrics
from services.broker import Broker
from services.config import AlertSettings, EngineSettings, Settings, StorageSettings
from services.gateway.app import create_app
from services.gateway.auth import hash_key
from services.gateway.status import NO_SNAPSHOTS
from services.serving import serve
from services.storage import repository
from services.storage.db import make_engine, session_factory
from services.storage.models import AlertRecord
from services.storage.repository import insert_summaries, save_snapshots, upsert_calibration
from sparse_engine.engine import Engine
from tests.aggregator_fixtures import pipeline_settings, running
from tests.gateway_fixtures import RecordingSink, running_gateway, settings_for
from tests.polling import wait_until
from tests.status_fixtures import (
    Element,
    Tab,
    artifacts_dir,
    browser_tab,
    dump_dom,
    migrated_database,
    needs_chromium,
    screenshot,
)
from tests.tiny import tiny_engine

USER_KEY = "sk-status-user-0123456789"
ADMIN_KEY = "sk-status-admin-9876543210"
# Fires on this traffic: the tiny engine's conservative plan keeps ~0.97 of the activation
# magnitude (above the band), its balanced plan ~0.89 (inside).
RULES = """
rules:
  - name: GateConfidenceOutOfBand
    metric: gate_confidence_mean
    window: 5m
    op: outside
    threshold: [0.75, 0.92]
    min_requests: 1
    for: 0s
    severity: warning
    annotations:
      summary: "Gate confidence out of band on {{ $labels.model }} ({{ $labels.level }})"
"""
LEVELS = ("conservative", "balanced")
REQUESTS_PER_LEVEL = 10
SNAPSHOTS = 3
TARGETS = {"conservative": 0.3, "balanced": 0.5, "aggressive": 0.7}  # tiny_engine()'s plans


@pytest.fixture
def empty_gateway(tmp_path: Path) -> Iterator[str]:
    with running_gateway(settings_for(tmp_path), tiny_engine(), RecordingSink()) as url:
        yield url


@pytest.fixture
def keyed_gateway(tmp_path: Path) -> Iterator[str]:
    settings = settings_for(
        tmp_path, api_key_hashes=[hash_key(USER_KEY)], admin_key_hashes=[hash_key(ADMIN_KEY)]
    )
    with running_gateway(settings, tiny_engine(), RecordingSink()) as url:
        yield url


def test_status_data_on_an_empty_database_says_so(empty_gateway: str) -> None:
    response = httpx.get(f"{empty_gateway}/status/data")
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["message"] == NO_SNAPSHOTS
    assert data["windows"] == data["series"] == data["alerts"] == []
    assert data["trust_actions"] == data["calibrations"] == []
    assert data["serving"]["levels"]["balanced"] == "tiny-balanced"
    assert data["gate_band"] == [0.75, 0.92]
    assert response.headers["cache-control"] == "no-store"


def test_status_data_needs_an_admin_key_when_keys_are_configured(keyed_gateway: str) -> None:
    page = httpx.get(f"{keyed_gateway}/status")  # the page itself holds no data
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    data_url = f"{keyed_gateway}/status/data"
    assert httpx.get(data_url).status_code == 401
    user = httpx.get(data_url, headers={"Authorization": f"Bearer {USER_KEY}"})
    assert user.status_code == 403
    assert user.json()["error"]["message"] == "this endpoint needs an admin API key"
    admin = httpx.get(data_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert admin.status_code == 200 and admin.json()["message"] == NO_SNAPSHOTS


def test_status_data_answers_503_when_the_database_cannot_be_read(tmp_path: Path) -> None:
    garbage = tmp_path / "not-a-database.sqlite"
    garbage.write_bytes(b"this is not an SQLite file" * 100)
    unreadable = StorageSettings(url=f"sqlite:///{garbage}")
    settings = settings_for(tmp_path).model_copy(update={"storage": unreadable})
    with running_gateway(settings, tiny_engine(), RecordingSink()) as url:
        response = httpx.get(f"{url}/status/data")
    assert response.status_code == 503
    assert "cannot be read" in response.json()["error"]["message"]
    assert "sqlite" not in response.text  # no connection details leak


@pytest.fixture(params=["sqlite", "postgresql"])
def sessions(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sessionmaker[Session]]:
    with migrated_database(request.param, tmp_path) as url:
        engine = make_engine(url)
        yield session_factory(engine)
        engine.dispose()


def test_status_reads_pick_current_recent_and_latest_rows(
    sessions: sessionmaker[Session],
) -> None:
    t0 = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
    with sessions.begin() as session:
        save_snapshots(
            session,
            [
                _snapshot("m", level, window, t0 + timedelta(minutes=minute))
                for level in ("balanced", "aggressive")
                for window in ("5m", "1h")
                for minute in (0, 1, 2)
            ],
        )
        session.add_all(
            [
                _alert("a", "pending", t0),
                _alert("a", "firing", t0 + timedelta(seconds=30)),
                _alert("b", "resolved", t0 + timedelta(seconds=10)),
            ]
        )
        insert_summaries(
            session,
            [
                _summary("old-flag", t0 - timedelta(hours=2), "flag"),
                _summary("flag", t0, "flag"),
                _summary("none", t0, "none"),
                _summary("unset", t0, None),
            ],
        )
        for minute, version in enumerate(("v1", "v2")):
            upsert_calibration(session, _calibration(version, t0 + timedelta(minutes=minute)))
    since = t0 + timedelta(minutes=1)
    with sessions() as session:
        current = repository.current_snapshots(session, since)
        history = repository.snapshots_since(session, "5m", since)
        alerts = repository.recent_alerts(session)
        trust = repository.recent_trust_actions(session, t0 - timedelta(hours=1))
        calibrations = repository.recent_calibrations(session)
    assert [(s.level, s.window, s.window_end) for s in current] == [
        (level, window, t0 + timedelta(minutes=2))
        for level in ("aggressive", "balanced")
        for window in ("1h", "5m")
    ]
    assert [(s.level, s.window, s.taken_at.minute) for s in history] == [
        (level, "5m", minute) for level in ("aggressive", "balanced") for minute in (1, 2)
    ]
    assert [(a.fingerprint, a.state) for a in alerts] == [("a", "firing"), ("b", "resolved")]
    assert [row.trace_id for row in trust] == ["flag"]
    assert [c.version for c in calibrations] == ["v2", "v1"]


@needs_chromium
def test_page_in_chromium_says_when_there_is_no_data(empty_gateway: str, tmp_path: Path) -> None:
    dom = dump_dom(f"{empty_gateway}/status", tmp_path / "profile")
    message = dom.find(id="message")
    assert "hidden" not in message.attrs and "No window snapshots" in message.text()
    assert _visible(dom, "content")
    assert dom.find("table", id="windows").text().endswith("No windows yet.")
    assert "tiny-balanced" in dom.find(id="serving").text()


@needs_chromium
def test_page_asks_for_the_admin_key_once_and_sends_it_as_bearer(
    keyed_gateway: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with browser_tab(tmp_path / "profile") as tab:
        tab.send("Page.navigate", url=f"{keyed_gateway}/status")
        tab.wait_for("!$('auth').hidden")
        assert tab.evaluate("$('content').hidden") and tab.evaluate("$('key').type") == "password"
        _submit_key(tab, USER_KEY)  # valid, but not an admin key
        tab.wait_for("$('auth-error').textContent")
        assert tab.evaluate("$('auth-error').textContent") == "this endpoint needs an admin API key"
        assert tab.evaluate("sessionStorage.length") == 0  # a refused key is not kept
        _submit_key(tab, ADMIN_KEY)
        tab.wait_for("!$('content').hidden")
        assert tab.evaluate("$('auth').hidden")
        assert tab.evaluate("$('message').textContent") == NO_SNAPSHOTS
        tab.evaluate("window.before = true")
        tab.send("Page.reload")
        tab.wait_for("!window.before && $('updated').textContent.startsWith('updated')")
        assert tab.evaluate("$('auth').hidden")  # asked once: the tab keeps the key
        assert ADMIN_KEY not in tab.evaluate("location.href + document.documentElement.outerHTML")
    assert ADMIN_KEY not in caplog.text and USER_KEY not in caplog.text


def _submit_key(tab: Tab, key: str) -> None:
    tab.evaluate(f"$('key').value = {json.dumps(key)}; $('auth').requestSubmit()")


@needs_chromium
def test_page_renders_real_traffic_in_chromium(kafka_broker: Broker, tmp_path: Path) -> None:
    settings = _pipeline(tmp_path, kafka_broker)
    sessions = session_factory(make_engine(settings.database_url))
    registry = CollectorRegistry()
    alerting = AlertLoop(settings.alerts, sessions, registry)
    aggregator = Aggregator(settings, sessions, AggregatorMetrics(registry), alerting=alerting)
    engine = tiny_engine()
    _register_calibrations(sessions, engine)
    with running(aggregator), serve(create_app(settings, engine=engine)) as url:
        flagged = _send_traffic(url)
        wait_until(lambda: aggregator.folded == len(LEVELS) * REQUESTS_PER_LEVEL)
        for i in range(SNAPSHOTS):
            time.sleep(1.0 if i else 0.0)  # spread the snapshots out in time
            aggregator.persist_snapshots()
        aggregator.evaluate_alerts()
        dom = dump_dom(f"{url}/status", tmp_path / "profile")
        shot = screenshot(f"{url}/status", artifacts_dir() / "status-page.png", tmp_path / "shot")
    _assert_windows(dom)
    _assert_charts_and_heatmaps(dom)
    alerts = dom.find("table", id="alerts").rows()
    assert [(r.attrs["data-alert"], r.attrs["data-state"]) for r in alerts] == [
        ("GateConfidenceOutOfBand", "firing")
    ]
    assert "level=conservative" in alerts[0].text()
    trust = dom.find("table", id="trust").rows()
    assert {r.attrs["data-trace"] for r in trust} == flagged and flagged
    calibrations = dom.find("table", id="calibrations").rows()
    assert {r.attrs["data-version"]: r.attrs["data-serving"] for r in calibrations} == {
        f"tiny-{level}": "true" for level in TARGETS
    }
    assert "hidden" in dom.find(id="message").attrs
    _assert_png(shot)


def _pipeline(tmp_path: Path, broker: Broker) -> Settings:
    """Gateway and aggregator on one SQLite database and one broker; snapshots and alert
    evaluations only when the test asks, and a KL drift measurement on every request."""
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    settings = pipeline_settings(tmp_path, broker.bootstrap, partitions=1)
    quiet = {"snapshot_interval_s": 3600.0}
    return settings.model_copy(
        update={
            "alerts": AlertSettings(rules_file=rules, evaluation_interval_s=3600.0),
            "aggregator": settings.aggregator.model_copy(update=quiet),
            "engine": EngineSettings(drift_sample_rate=1.0),
        }
    )


def _register_calibrations(sessions: sessionmaker[Session], engine: Engine) -> None:
    """The tiny engine's plans as calibration versions (made by uniform targets, so no
    held-out perplexity was measured)."""
    with sessions.begin() as session:
        for level, plan in engine.plans.items():
            if plan.calibration_version is None:
                continue
            upsert_calibration(
                session,
                {
                    "version": plan.calibration_version,
                    "model_id": engine.lm.model_id,
                    "level": level.value,
                    "weights_sha256": engine.lm.weights_sha256,
                    "created_at": datetime.now(UTC),
                    "target_sparsity": TARGETS[level.value],
                    "realised_sparsity": None,
                    "perplexity_change_pct": None,
                    "reason": "cli",
                    "artefact": {"level": level.value},
                },
            )


def _send_traffic(url: str) -> set[str]:
    """Real chat requests at each level; returns the trace ids the gateway flagged."""
    flagged = set()
    with httpx.Client(base_url=url, timeout=30) as client:
        for i in range(REQUESTS_PER_LEVEL):
            for level in LEVELS:
                body = {
                    "messages": [{"role": "user", "content": f"Question {i}: what is sparsity?"}],
                    "max_tokens": 8,
                    "ir_sparse_level": level,
                }
                response = client.post("/v1/chat/completions", json=body)
                assert response.status_code == 200, response.text
                if response.headers["x-ir-trust"].endswith(";silence-spike"):
                    flagged.add(response.headers["x-ir-trace-id"])
    return flagged


def _assert_windows(dom: Element) -> None:
    rows = dom.find("table", id="windows").rows()
    assert {(r.attrs["data-level"], r.attrs["data-window"]) for r in rows} == {
        (level, window) for level in LEVELS for window in ("5m", "1h", "24h")
    }
    five = {r.attrs["data-level"]: r for r in rows if r.attrs["data-window"] == "5m"}
    for row in five.values():
        assert row.find("td", **{"class": "requests"}).text() == str(REQUESTS_PER_LEVEL)
    out_of_band = {level: row.find(data_out_of_band=None) for level, row in five.items()}
    assert out_of_band["conservative"].attrs["data-out-of-band"] == "true"
    assert "bad" in out_of_band["conservative"].attrs["class"]
    assert out_of_band["balanced"].attrs["data-out-of-band"] == "false"


def _assert_charts_and_heatmaps(dom: Element) -> None:
    for chart in ("sparsity", "gate_confidence", "drift_kl"):
        svg = dom.find("svg", data_chart=chart)
        for level in LEVELS:
            points = svg.find_all("circle", data_series=f"tiny-llama/{level}")
            assert len(points) == SNAPSHOTS, chart
            assert len(svg.find_all("path", data_series=f"tiny-llama/{level}")) == 1
    assert len(dom.find("svg", data_chart="gate_confidence").find_all("rect", data_band=None)) == 1
    for level in LEVELS:
        cells = dom.find("svg", data_heatmap=f"tiny-llama/{level}").find_all("rect")
        assert len(cells) == 2 * SNAPSHOTS  # the tiny model's 2 layers x snapshot times
        assert {c.attrs["data-layer"] for c in cells} == {"0", "1"}
        assert len({c.attrs["data-t"] for c in cells}) == SNAPSHOTS
    assert len(dom.find("svg", id="heat-legend").find_all("lineargradient")) == 1  # parsed lower


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1280, 1600)


def _visible(dom: Element, element_id: str) -> bool:
    return "hidden" not in dom.find(id=element_id).attrs


def _snapshot(model: str, level: str, window: str, at: datetime) -> dict[str, Any]:
    data = {"window": window, "requests": 1, "silence_rate_per_layer": [0.1, 0.2]}
    return {
        "model": model,
        "level": level,
        "window": window,
        "window_end": at,
        "taken_at": at,
        "data": data,
    }


def _alert(fingerprint: str, state: str, at: datetime) -> AlertRecord:
    return AlertRecord(
        fingerprint=fingerprint,
        name=f"Alert-{fingerprint}",
        state=state,
        severity="warning",
        labels={"model": "m"},
        annotations={},
        value=0.5,
        starts_at=at,
        ends_at=at if state == "resolved" else None,
        updated_at=at,
    )


def _summary(trace_id: str, at: datetime, action: str | None) -> dict[str, Any]:
    return {
        "trace_id": trace_id,
        "time": at,
        "model": "m",
        "level": "balanced",
        "mode": "serve",
        "api": "openai",
        "status": "ok",
        "trust_score": 0.2,
        "trust_action": action,
        "event": {"trace_id": trace_id},
    }


def _calibration(version: str, at: datetime) -> dict[str, Any]:
    return {
        "version": version,
        "model_id": "m",
        "level": "balanced",
        "weights_sha256": "ab" * 32,
        "created_at": at,
        "target_sparsity": 0.5,
        "reason": "cli",
        "artefact": {"thresholds": [0.1]},
    }
