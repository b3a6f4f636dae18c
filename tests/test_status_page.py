"""The gateway's status page: /status/data on an empty database and behind admin keys, and end
to end in headless Chromium after real traffic (gateway -> real broker -> aggregator -> SQL ->
page), asserting on what the page rendered. The SQL reads behind it: test_status_reads.py."""

from __future__ import annotations

import json
import logging
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.config import SignalSettings, StorageSettings
from services.gateway.app import create_app
from services.gateway.auth import hash_key
from services.gateway.routes.status import NO_SNAPSHOTS
from services.shared.serving import serve
from services.telemetry.broker import Broker
from tests.aggregator_fixtures import running
from tests.gateway_fixtures import RecordingSink, running_gateway, settings_for
from tests.polling import wait_until
from tests.status_fixtures import (
    Element,
    Tab,
    artifacts_dir,
    browser_tab,
    dump_dom,
    needs_chromium,
    screenshot,
)
from tests.tiny import tiny_engine
from tests.traffic_fixtures import (
    LEVELS,
    TARGETS,
    alerting_aggregator,
    register_calibrations,
    send_traffic,
    traffic_settings,
)

USER_KEY = "sk-status-user-0123456789"
ADMIN_KEY = "sk-status-admin-9876543210"
REQUESTS_PER_LEVEL = 10
SNAPSHOTS = 3


@pytest.fixture
def empty_gateway(tmp_path: Path) -> Iterator[str]:
    settings = settings_for(tmp_path)
    settings.signals = SignalSettings(gate_band=(0.6, 0.9), spike_silence=0.7)
    with running_gateway(settings, tiny_engine(), RecordingSink()) as url:
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
    assert (data["gate_band"], data["spike_silence"]) == ([0.6, 0.9], 0.7)  # from settings
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
    settings = traffic_settings(tmp_path, kafka_broker)
    aggregator = alerting_aggregator(settings)
    engine = tiny_engine()
    register_calibrations(aggregator.sessions, engine)
    with running(aggregator), serve(create_app(settings, engine=engine)) as url:
        with httpx.Client(base_url=url, timeout=30) as client:
            flagged = send_traffic(client, range(REQUESTS_PER_LEVEL))
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
