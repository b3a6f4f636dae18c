"""The status page on healthy traffic, in headless Chromium: each level's calibration carries a
healthy baseline measured on the same engine (other prompts of the same kind), the default
alert rules judge real traffic against it (enough requests that every window rule applies),
and the page shows no marked cell and no alert. Saves `.artifacts/status-page-healthy.png`."""

from __future__ import annotations

from pathlib import Path

import httpx

from alerts.rules import DEFAULT_RULES, load_rules
from services.gateway.app import create_app
from services.shared.serving import serve
from services.telemetry.broker import Broker
from tests.aggregator_fixtures import running
from tests.polling import wait_until
from tests.status_fixtures import artifacts_dir, dump_dom, needs_chromium, screenshot
from tests.tiny import tiny_engine
from tests.traffic_fixtures import (
    LEVELS,
    TRAFFIC_ROUNDS,
    alerting_aggregator,
    register_healthy_calibrations,
    send_traffic,
    traffic_settings,
)

REQUESTS_PER_LEVEL = len(TRAFFIC_ROUNDS)  # over every window rule's min_requests (20)


@needs_chromium
def test_healthy_traffic_leaves_the_status_page_green(kafka_broker: Broker, tmp_path: Path) -> None:
    settings = traffic_settings(tmp_path, kafka_broker)
    settings.alerts.rules_file = DEFAULT_RULES
    aggregator = alerting_aggregator(settings)
    engine = tiny_engine()
    register_healthy_calibrations(settings, engine)
    with running(aggregator), serve(create_app(settings, engine=engine)) as url:
        with httpx.Client(base_url=url, timeout=30) as client:
            send_traffic(client, TRAFFIC_ROUNDS)
        wait_until(lambda: aggregator.folded == len(LEVELS) * REQUESTS_PER_LEVEL)
        aggregator.persist_snapshots()
        aggregator.evaluate_alerts()
        windows = aggregator.snapshot()
        dom = dump_dom(f"{url}/status", tmp_path / "profile")
        shot = artifacts_dir() / "status-page-healthy.png"
        screenshot(f"{url}/status", shot, tmp_path / "shot")
    # The window rules had data: the baselines were read and the windows were full enough.
    rules = load_rules(DEFAULT_RULES, settings.signals.as_thresholds())
    assert min(r.min_requests for r in rules if r.window) <= REQUESTS_PER_LEVEL
    for level in LEVELS:
        five = windows[(engine.lm.model_id, level)]["5m"]
        assert five.requests == REQUESTS_PER_LEVEL
        assert {"sparsity", "gate_confidence", "late_silence"} <= {
            name for name, ref in five.references.items() if ref.source == "baseline"
        }
        assert five.layer_sparsity_shift is not None
    rows = dom.find("table", id="windows").rows()
    assert len(rows) == len(LEVELS) * 3
    marked = [c.text() for r in rows for c in r.find_all("td") if "bad" in c.attrs.get("class", "")]
    assert marked == []
    assert dom.find("table", id="alerts").text().strip().endswith("No alerts.")
    assert shot.stat().st_size > 20_000
