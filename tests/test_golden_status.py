"""The status page shows each level's latest golden-set check with its interval and status,
`inconclusive` included: /status/data and the page rendered in headless Chromium."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx

from services.storage import repository
from services.storage.db import make_engine, session_factory, upgrade
from services.workers import golden
from services.workers.golden_score import LevelDrift
from tests.gateway_fixtures import RecordingSink, running_gateway, settings_for
from tests.status_fixtures import dump_dom, needs_chromium
from tests.tiny import tiny_engine

NOW = datetime.now(UTC)
BUDGET = 2.0


def run(level: str, drift: float, low: float, high: float) -> LevelDrift:
    return LevelDrift(
        level, f"{level}-v2", "chrf+f1", 50.0, 50.0 - drift, drift, low, high, 0.02, 4, 100
    )


def store_checks(home: Path) -> None:
    """An older over-budget balanced run, then the latest of each level."""
    url = settings_for(home).database_url
    upgrade(url)
    sessions = session_factory(make_engine(url))
    with sessions.begin() as session:
        old = [run("balanced", 9.0, 6.0, 12.0)]
        golden.store_runs(session, "m", old, NOW - timedelta(days=1), BUDGET)
        latest = [run("balanced", 1.5, -0.5, 3.5), run("aggressive", 6.0, 3.1, 9.0)]
        golden.store_runs(session, "m", latest, NOW, BUDGET)
    with sessions() as session:
        rows = repository.latest_golden_runs(session)
    assert [(r.level, r.status) for r in rows] == [
        ("aggressive", "over-budget"),
        ("balanced", "inconclusive"),
    ]


def test_status_data_has_the_latest_check_per_level(tmp_path: Path) -> None:
    store_checks(tmp_path)
    with running_gateway(settings_for(tmp_path), tiny_engine(), RecordingSink()) as url:
        data = httpx.get(f"{url}/status/data").json()
    by_level = {g["level"]: g for g in data["golden"]}
    assert by_level["balanced"]["status"] == "inconclusive"
    assert (by_level["balanced"]["drift_low"], by_level["balanced"]["drift_high"]) == (-0.5, 3.5)
    assert by_level["aggressive"]["status"] == "over-budget"
    assert by_level["aggressive"]["metric"] == "chrf+f1"


@needs_chromium
def test_the_page_shows_an_inconclusive_check(tmp_path: Path) -> None:
    store_checks(tmp_path)
    with running_gateway(settings_for(tmp_path), tiny_engine(), RecordingSink()) as url:
        dom = dump_dom(f"{url}/status", tmp_path / "profile")
    rows = {r.attrs["data-level"]: r for r in dom.find("table", id="golden").rows()}
    assert rows["balanced"].attrs["data-status"] == "inconclusive"
    assert "inconclusive" in rows["balanced"].text()
    assert "1.50 [-0.50, 3.50]" in rows["balanced"].text()
    assert "over-budget" in rows["aggressive"].text()
