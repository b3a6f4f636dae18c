"""Typed builders for Grafana dashboard JSON: `Target` (one PromQL query), `Panel`, `Row` and
`Dashboard`. `Dashboard.to_json()` numbers the panels and flows them left to right over
Grafana's 24-column grid, so the output depends only on the declarations."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

JSON = dict[str, Any]
DATASOURCE: JSON = {"type": "prometheus", "uid": "${datasource}"}
# The data source uid in provisioning/datasources: the ${datasource} variable's first choice;
# where it does not exist (a pushed dashboard), Grafana falls back to its default Prometheus.
PROVISIONED_DATASOURCE = "sparseguard-prometheus"
GRID_WIDTH = 24
SCHEMA_VERSION = 39
TAG = "sparseguard"
# Thresholds in PromQL units; a Grafana threshold list starts with a base step (value null).
Step = tuple[float, str]


@dataclass(frozen=True, slots=True)
class Target:
    expr: str
    legend: str = ""

    def to_json(self, ref_id: str) -> JSON:
        return {
            "datasource": DATASOURCE,
            "expr": self.expr,
            "legendFormat": self.legend or "__auto",
            "range": True,
            "refId": ref_id,
        }


@dataclass(frozen=True, slots=True)
class Panel:
    title: str
    targets: tuple[Target, ...]
    kind: str = "timeseries"
    description: str = ""
    unit: str = "short"
    width: int = 12
    height: int = 8
    min: float | None = None
    max: float | None = None
    base_color: str = "green"
    steps: tuple[Step, ...] = ()
    # timeseries only: how to draw the thresholds ("off", "line", "area", "line+area")
    show_thresholds: str = "off"
    color: str = ""  # a Grafana color mode; default: palette for time series, else thresholds

    def to_json(self, panel_id: int, x: int, y: int) -> JSON:
        return {
            "datasource": DATASOURCE,
            "description": self.description,
            "fieldConfig": {"defaults": self._defaults(), "overrides": []},
            "gridPos": {"h": self.height, "w": self.width, "x": x, "y": y},
            "id": panel_id,
            "options": OPTIONS.get(self.kind, {}),
            "targets": [t.to_json(chr(ord("A") + i)) for i, t in enumerate(self.targets)],
            "title": self.title,
            "type": self.kind,
        }

    def _defaults(self) -> JSON:
        color = self.color or ("palette-classic" if self.kind == "timeseries" else "thresholds")
        steps: list[JSON] = [{"color": self.base_color, "value": None}]
        steps += [{"color": c, "value": v} for v, c in self.steps]
        custom = CUSTOM.get(self.kind, {})
        if self.kind == "timeseries":
            custom = {**custom, "thresholdsStyle": {"mode": self.show_thresholds}}
        defaults: JSON = {
            "color": {"mode": color},
            "custom": custom,
            "thresholds": {"mode": "absolute", "steps": steps},
            "unit": self.unit,
        }
        defaults |= {k: v for k, v in (("min", self.min), ("max", self.max)) if v is not None}
        return defaults


@dataclass(frozen=True, slots=True)
class Row:
    title: str

    def to_json(self, panel_id: int, y: int) -> JSON:
        return {
            "collapsed": False,
            "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y},
            "id": panel_id,
            "panels": [],
            "title": self.title,
            "type": "row",
        }


@dataclass(frozen=True, slots=True)
class Dashboard:
    uid: str
    title: str
    description: str
    items: tuple[Panel | Row, ...]

    def panels(self) -> Iterator[Panel]:
        return (item for item in self.items if isinstance(item, Panel))

    def to_json(self) -> JSON:
        return {
            "annotations": {"list": []},
            "description": self.description,
            "editable": True,
            "graphTooltip": 1,  # shared crosshair
            "links": [LINKS],
            "panels": self._layout(),
            "refresh": "30s",
            "schemaVersion": SCHEMA_VERSION,
            "tags": [TAG],
            "templating": {"list": VARIABLES},
            "time": {"from": "now-6h", "to": "now"},
            "timezone": "browser",
            "title": self.title,
            "uid": self.uid,
            "version": 1,
        }

    def _layout(self) -> list[JSON]:
        placed: list[JSON] = []
        x = y = line_height = 0
        for panel_id, item in enumerate(self.items, start=1):
            if isinstance(item, Row) or x + item.width > GRID_WIDTH:
                x, y, line_height = 0, y + line_height, 0
            if isinstance(item, Row):
                placed.append(item.to_json(panel_id, y))
                y += 1
                continue
            placed.append(item.to_json(panel_id, x, y))
            x, line_height = x + item.width, max(line_height, item.height)
        return placed


def query_variable(name: str, label: str, query: str) -> JSON:
    return {
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "datasource": DATASOURCE,
        "definition": query,
        "includeAll": True,
        "label": label,
        "multi": True,
        "name": name,
        "query": query,
        "refresh": 2,  # on time range change: new models and levels show up
        "sort": 1,
        "type": "query",
    }


VARIABLES: list[JSON] = [
    {
        "current": {"selected": True, "text": "Prometheus", "value": PROVISIONED_DATASOURCE},
        "includeAll": False,
        "label": "Data source",
        "name": "datasource",
        "query": "prometheus",
        "refresh": 1,
        "type": "datasource",
    },
    query_variable("model", "Model", "label_values(sparseguard_events_total, model)"),
    query_variable(
        "level", "Level", 'label_values(sparseguard_events_total{model=~"$model"}, level)'
    ),
]
LINKS: JSON = {
    "asDropdown": True,
    "includeVars": True,
    "keepTime": True,
    "tags": [TAG],
    "title": "SparseGuard",
    "type": "dashboards",
}
OPTIONS: dict[str, JSON] = {
    "timeseries": {
        "legend": {"calcs": [], "displayMode": "list", "placement": "bottom", "showLegend": True},
        "tooltip": {"mode": "multi", "sort": "desc"},
    },
    "stat": {
        "colorMode": "value",
        "graphMode": "area",
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
        "textMode": "auto",
    },
    "bargauge": {
        "displayMode": "gradient",
        "orientation": "horizontal",
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
    },
    "status-history": {
        "colWidth": 1,
        "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
        "rowHeight": 0.9,
        "showValue": "never",
        "tooltip": {"mode": "single", "sort": "none"},
    },
    "state-timeline": {
        "alignValue": "left",
        "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
        "mergeValues": True,
        "rowHeight": 0.9,
        "showValue": "auto",
        "tooltip": {"mode": "single", "sort": "none"},
    },
}
CUSTOM: dict[str, JSON] = {
    "timeseries": {"drawStyle": "line", "fillOpacity": 10, "lineWidth": 1, "showPoints": "never"},
    "status-history": {"fillOpacity": 90, "lineWidth": 0},
    "state-timeline": {"fillOpacity": 80, "lineWidth": 0},
}
