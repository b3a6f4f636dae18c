"""SparseGuard's Grafana dashboards as code: the four dashboards (`dashboards(signals)`, and
`DASHBOARDS` with the published signal thresholds), their JSON (`render`, `write_all`; committed
under dashboards/json, provisioned from there) and their queries as plain PromQL (`queries`).
Threshold lines and titles come from the signal settings. Builders: dashboards/model.py;
upload: dashboards/push.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

from dashboards.jobs import jobs
from dashboards.model import Dashboard
from dashboards.overview import overview
from dashboards.pipeline import PIPELINE
from dashboards.silence import silence
from services.config import SignalSettings, TrustSettings


def dashboards(
    signals: SignalSettings | None = None, trust: TrustSettings | None = None
) -> tuple[Dashboard, ...]:
    """The four dashboards, drawn with `signals`' thresholds and `trust`'s flag budget
    (default: the published ones)."""
    return (overview(signals, trust), silence(signals), PIPELINE, jobs(signals))


DASHBOARDS = dashboards()  # with the published thresholds: the committed JSON
JSON_DIR = Path(__file__).parent / "json"
PROVISIONING_DIR = Path(__file__).parent / "provisioning"
# What each template variable becomes when a query runs on Prometheus directly.
DEFAULTS = {"model": ".*", "level": ".*", "__rate_interval": "5m"}
VARIABLE = re.compile(r"\$\{?(\w+)\}?")


def render(dashboard: Dashboard) -> str:
    """The dashboard's JSON text: sorted keys, indent 2, trailing newline (stable diffs)."""
    return json.dumps(dashboard.to_json(), indent=2, sort_keys=True) + "\n"


def write_all(
    out: Path = JSON_DIR, signals: SignalSettings | None = None, trust: TrustSettings | None = None
) -> list[Path]:
    """Write every dashboard to `out/<uid>.json`; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for dashboard in dashboards(signals, trust):
        path = out / f"{dashboard.uid}.json"
        path.write_text(render(dashboard), encoding="utf-8")
        paths.append(path)
    return paths


def substitute(expr: str) -> str:
    """`expr` with the template variables replaced by `DEFAULTS` (all models and levels)."""
    return VARIABLE.sub(lambda m: DEFAULTS[m.group(1)], expr)


def queries() -> list[tuple[str, str, str]]:
    """(dashboard uid, panel title, PromQL runnable on Prometheus) for every panel target."""
    return [
        (dashboard.uid, panel.title, substitute(target.expr))
        for dashboard in DASHBOARDS
        for panel in dashboard.panels()
        for target in panel.targets
    ]
