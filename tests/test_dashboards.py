"""The Grafana dashboards as code: deterministic JSON equal to the committed files, bound to
the services' metric tables (names and labels), provisioning files that match, and
`sparseguard dashboards push` against a fake Grafana."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import pytest
import yaml
from fastapi import Depends, FastAPI, Header, HTTPException
from prometheus_client import Histogram

from dashboards import DASHBOARDS, JSON_DIR, PROVISIONING_DIR, queries, render
from dashboards.__main__ import main as generate_main
from dashboards.model import PROVISIONED_DATASOURCE
from services.aggregator.alert_loop import ALERTING_METRICS
from services.aggregator.metrics import AGGREGATOR_METRICS
from services.alerting.webhooks import METRICS as WEBHOOK_METRICS
from services.cli import main
from services.config import SignalSettings
from services.gateway.metrics import GATEWAY_METRICS
from services.shared.serving import free_port, serve
from tests.test_prometheus_rules import exposed_names

UIDS = ["sparseguard-overview", "sparseguard-silence", "sparseguard-pipeline", "sparseguard-jobs"]
TABLES = (*AGGREGATOR_METRICS, *GATEWAY_METRICS, *ALERTING_METRICS, *WEBHOOK_METRICS)
COMPOSE = Path(__file__).parents[1] / "docker-compose.yml"
SCRAPE_LABELS = {"instance", "job"}
TOKEN = "glsa_test-token-0123456789"


def series_labels() -> dict[str, set[str]]:
    """Every series the services expose, with the labels it carries."""
    labels: dict[str, set[str]] = {}
    for spec in TABLES:
        for name in exposed_names(spec):
            extra = {"le"} if spec.kind is Histogram and name.endswith("_bucket") else set()
            labels[name] = set(spec.labels) | extra | SCRAPE_LABELS
    return labels


def expressions() -> list[str]:
    """Every PromQL text in the dashboards: panel targets and template variable queries."""
    texts = [t.expr for d in DASHBOARDS for p in d.panels() for t in p.targets]
    variables = [v for d in DASHBOARDS for v in d.to_json()["templating"]["list"]]
    return texts + [v["query"] for v in variables if v["type"] == "query"]


def committed() -> dict[str, str]:
    return {path.name: path.read_text(encoding="utf-8") for path in JSON_DIR.glob("*.json")}


def test_regenerating_gives_exactly_the_committed_json(tmp_path: Path) -> None:
    generate_main(["--out", str(tmp_path / "module")])
    assert main(["dashboards", "generate", "--out", str(tmp_path / "cli")]) == 0
    for out in ("module", "cli"):
        generated = {p.name: p.read_text(encoding="utf-8") for p in (tmp_path / out).iterdir()}
        assert generated == committed(), "run `python -m dashboards` and commit the JSON"
    assert all(render(d) == render(d) for d in DASHBOARDS)


def test_uids_are_stable_unique_and_name_their_files() -> None:
    assert [d.uid for d in DASHBOARDS] == UIDS
    for name, text in committed().items():
        dashboard = json.loads(text)
        assert name == f"{dashboard['uid']}.json"
        assert "id" not in dashboard  # Grafana matches on uid; a fixed id would clash
        ids = [panel["id"] for panel in dashboard["panels"]]
        assert len(ids) == len(set(ids))
        assert text.endswith("}\n")


def test_every_metric_in_the_dashboards_exists_in_the_metric_tables() -> None:
    known = series_labels()
    named = {name for expr in expressions() for name in re.findall(r"\bsparseguard_\w+", expr)}
    assert named - known.keys() == set()
    for expected in (
        "sparseguard_window_silence_rate_ratio",
        "sparseguard_webhook_deliveries_total",
        "sparseguard_alert_transitions_total",
        "sparseguard_request_ttft_seconds_bucket",
        "sparseguard_calibration_reloads_total",
        "sparseguard_telemetry_spool_bytes",
    ):
        assert expected in named


def test_every_label_a_query_selects_groups_or_shows_exists_on_its_metrics() -> None:
    known = series_labels()
    for d in DASHBOARDS:
        for panel in d.panels():
            for target in panel.targets:
                names = re.findall(r"\bsparseguard_\w+", target.expr)
                available = set().union(*(known[n] for n in names)) if names else SCRAPE_LABELS
                for name, matchers in re.findall(r"\b(sparseguard_\w+)\{([^}]*)\}", target.expr):
                    assert set(re.findall(r"(\w+)\s*[=!]", matchers)) <= known[name], target
                grouped = re.findall(r"\bby \(([^)]*)\)", target.expr)
                assert {g.strip() for gs in grouped for g in gs.split(",")} <= available, target
                assert set(re.findall(r"\{\{(\w+)\}\}", target.legend)) <= available, target


def test_queries_are_plain_promql_for_every_target() -> None:
    found = queries()
    assert len(found) == sum(len(p.targets) for d in DASHBOARDS for p in d.panels())
    assert {uid for uid, _, _ in found} == set(UIDS)
    assert all("$" not in expr for _, _, expr in found)
    assert (
        "sparseguard-silence",
        "Silence rate per layer (5m window)",
        'avg by (layer) (sparseguard_window_silence_rate_ratio{model=~".*", level=~".*", '
        'window="5m"})',
    ) in found


def panel(uid: str, title: str) -> dict[str, Any]:
    dashboard = json.loads((JSON_DIR / f"{uid}.json").read_text(encoding="utf-8"))
    return next(p for p in dashboard["panels"] if p["title"] == title)


def steps(p: dict[str, Any]) -> list[float]:
    return [s["value"] for s in p["fieldConfig"]["defaults"]["thresholds"]["steps"][1:]]


def test_committed_panels_show_the_default_signal_limits_and_use_the_datasource_variable() -> None:
    signals = SignalSettings()  # the committed JSON is drawn with the default settings
    low, high = signals.gate_band
    gate = panel("sparseguard-overview", f"Gate confidence (healthy band {low:g}-{high:g})")
    assert steps(gate)[:2] == [low, high]
    assert gate["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] == "line+area"
    drift = panel("sparseguard-jobs", "Golden-set drift per level (points)")
    assert steps(drift) == [signals.drift_budget, signals.drift_recalibrate]
    heat = panel("sparseguard-silence", "Silence rate per layer (5m window)")
    assert heat["type"] == "status-history"
    assert heat["targets"][0]["legendFormat"] == "layer {{layer}}"
    for d in DASHBOARDS:
        spec = d.to_json()
        variables = {v["name"]: v for v in spec["templating"]["list"]}
        assert variables.keys() == {"datasource", "model", "level"}
        assert variables["datasource"]["query"] == "prometheus"
        for p in spec["panels"]:
            if p["type"] != "row":
                assert p["targets"], p["title"]
                sources = [p["datasource"], *(t["datasource"] for t in p["targets"])]
                assert all(s == {"type": "prometheus", "uid": "${datasource}"} for s in sources)


def test_provisioning_points_at_the_datasource_and_the_mounted_json() -> None:
    sources = yaml.safe_load((PROVISIONING_DIR / "datasources/prometheus.yaml").read_text())
    [source] = sources["datasources"]
    assert source["uid"] == PROVISIONED_DATASOURCE
    assert (source["type"], source["url"], source["isDefault"]) == (
        "prometheus",
        "${PROMETHEUS_URL}",
        True,
    )
    providers = yaml.safe_load((PROVISIONING_DIR / "dashboards/sparseguard.yaml").read_text())
    [provider] = providers["providers"]
    assert provider["type"] == "file"
    grafana = yaml.safe_load(COMPOSE.read_text())["services"]["grafana"]
    mounts = {v.split(":")[0]: v.split(":")[1] for v in grafana["volumes"]}
    assert mounts["./dashboards/json"] == provider["options"]["path"]
    assert mounts["./dashboards/provisioning/datasources"].endswith("provisioning/datasources")
    for d in DASHBOARDS:
        [variable] = [v for v in d.to_json()["templating"]["list"] if v["type"] == "datasource"]
        assert variable["current"]["value"] == PROVISIONED_DATASOURCE


@dataclass
class FakeGrafana:
    """What the fake Grafana was sent."""

    folders: list[dict[str, Any]] = field(default_factory=list)
    uploads: list[dict[str, Any]] = field(default_factory=list)


def fake_grafana(state: FakeGrafana) -> FastAPI:
    """The few Grafana HTTP API endpoints `dashboards push` uses, behind a bearer token."""

    def authorized(authorization: Annotated[str, Header()] = "") -> None:
        if authorization != f"Bearer {TOKEN}":
            raise HTTPException(401, "Invalid API key")

    app = FastAPI(dependencies=[Depends(authorized)])

    @app.get("/api/folders")
    def folders() -> list[dict[str, Any]]:
        return state.folders

    @app.post("/api/folders")
    def create_folder(body: dict[str, Any]) -> dict[str, Any]:
        folder = {"id": len(state.folders) + 1, "uid": f"f{len(state.folders)}", **body}
        state.folders.append(folder)
        return folder

    @app.post("/api/dashboards/db")
    def upload(body: dict[str, Any]) -> dict[str, Any]:
        state.uploads.append(body)
        uid = body["dashboard"]["uid"]
        return {"status": "success", "uid": uid, "url": f"/d/{uid}/x", "version": 1}

    return app


@pytest.fixture
def grafana() -> Iterator[tuple[str, FakeGrafana]]:
    """A fake Grafana on loopback: no Grafana server can run in the test environment."""
    state = FakeGrafana()
    with serve(fake_grafana(state)) as url:
        yield url, state


def test_push_uploads_every_dashboard_into_one_folder_with_overwrite(
    grafana: tuple[str, FakeGrafana], capsys: pytest.CaptureFixture[str]
) -> None:
    url, state = grafana
    for _ in range(2):  # the second push finds the folder and overwrites
        argv = ["dashboards", "push", "--grafana-url", url, "--token", TOKEN, "--folder", "SG"]
        assert main(argv) == 0
    assert [f["title"] for f in state.folders] == ["SG"]
    assert [u["dashboard"]["uid"] for u in state.uploads] == UIDS * 2
    assert all(u["overwrite"] is True and u["folderUid"] == "f0" for u in state.uploads)
    assert state.uploads[0]["dashboard"] == json.loads(committed()["sparseguard-overview.json"])
    out, err = capsys.readouterr()
    assert f"sparseguard-jobs {url}/d/sparseguard-jobs/x\n" in out
    assert TOKEN not in out + err


def test_push_with_a_wrong_token_says_so_without_printing_it(
    grafana: tuple[str, FakeGrafana],
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    url, state = grafana
    wrong = "glsa_wrong-token-9876543210"
    caplog.set_level(logging.DEBUG)  # the CLI logs the failure's traceback at debug level
    assert main(["-v", "dashboards", "push", "--grafana-url", url, "--token", wrong]) == 2
    out, err = capsys.readouterr()
    assert "rejected the token (401 Unauthorized)" in err
    assert "--token" in err
    assert "GrafanaUnauthorizedError" in caplog.text
    assert wrong not in out + err + caplog.text
    assert state.uploads == []


def test_push_to_an_unreachable_grafana_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert main(["dashboards", "push", "--grafana-url", url, "--token", TOKEN]) == 2
    out, err = capsys.readouterr()
    assert f"cannot reach Grafana at {url}/" in err
    assert "Traceback" not in err
    assert TOKEN not in out + err
