"""What a dashboard declares: `Target` (one PromQL query), `Panel`, `Row` and `Dashboard`;
`Dashboard.to_json()` builds it with Grafana's own typed builders (`grafana-foundation-sdk`,
generated from Grafana's schemas), which number the panels and flow them left to right over
the 24-column grid, so the output depends only on the declarations."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from grafana_foundation_sdk.builders import (
    bargauge,
    prometheus,
    stat,
    statetimeline,
    statushistory,
    timeseries,
)
from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm

JSON = dict[str, Any]
DATASOURCE = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
# The data source uid in provisioning/datasources: the ${datasource} variable's first choice;
# where it does not exist (a pushed dashboard), Grafana falls back to its default Prometheus.
PROVISIONED_DATASOURCE = "sparseguard-prometheus"
TAG = "sparseguard"
# Thresholds in PromQL units; a Grafana threshold list starts with a base step (value null).
Step = tuple[float, str]


@dataclass(frozen=True, slots=True)
class Target:
    expr: str
    legend: str = ""

    def build(self, ref_id: str) -> prometheus.Dataquery:
        query = prometheus.Dataquery().expr(self.expr).legend_format(self.legend or "__auto")
        return query.range().ref_id(ref_id).datasource(DATASOURCE)


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

    def build(self, panel_id: int) -> Any:
        panel = KINDS[self.kind]()
        panel.id(panel_id).title(self.title).description(self.description)
        panel.datasource(DATASOURCE).unit(self.unit).span(self.width).height(self.height)
        for i, target in enumerate(self.targets):
            panel.with_target(target.build(chr(ord("A") + i)))
        color = self.color or ("palette-classic" if self.kind == "timeseries" else "thresholds")
        panel.color_scheme(db.FieldColor().mode(dm.FieldColorModeId(color)))
        steps = [dm.Threshold(value=None, color=self.base_color)]
        steps += [dm.Threshold(value=v, color=c) for v, c in self.steps]
        panel.thresholds(db.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps(steps))
        if self.min is not None:
            panel.min(self.min)
        if self.max is not None:
            panel.max(self.max)
        if self.kind == "timeseries":
            style = cb.GraphThresholdsStyleConfig().mode(
                cm.GraphTresholdsStyleMode(self.show_thresholds)
            )
            panel.thresholds_style(style)
        return panel


def _timeseries() -> timeseries.Panel:
    return (
        timeseries.Panel()
        .legend(_legend())
        .tooltip(
            cb.VizTooltipOptions().mode(cm.TooltipDisplayMode.MULTI).sort(cm.SortOrder.DESCENDING)
        )
        .draw_style(cm.GraphDrawStyle.LINE)
        .fill_opacity(10)
        .line_width(1)
        .show_points(cm.VisibilityMode.NEVER)
    )


def _stat() -> stat.Panel:
    return (
        stat.Panel()
        .color_mode(cm.BigValueColorMode.VALUE)
        .graph_mode(cm.BigValueGraphMode.AREA)
        .reduce_options(_last())
        .text_mode(cm.BigValueTextMode.AUTO)
    )


def _bargauge() -> bargauge.Panel:
    return (
        bargauge.Panel()
        .display_mode(cm.BarGaugeDisplayMode.GRADIENT)
        .orientation(cm.VizOrientation.HORIZONTAL)
        .reduce_options(_last())
    )


def _status_history() -> statushistory.Panel:
    return (
        statushistory.Panel()
        .col_width(1)
        .legend(_legend())
        .row_height(0.9)
        .show_value(cm.VisibilityMode.NEVER)
        .tooltip(_single())
        .fill_opacity(90)
        .line_width(0)
    )


def _state_timeline() -> statetimeline.Panel:
    return (
        statetimeline.Panel()
        .align_value(cm.TimelineValueAlignment.LEFT)
        .legend(_legend())
        .merge_values(True)
        .row_height(0.9)
        .show_value(cm.VisibilityMode.AUTO)
        .tooltip(_single())
        .fill_opacity(80)
        .line_width(0)
    )


# The panel builders share no typed base with these methods: built through Any.
KINDS: dict[str, Callable[[], Any]] = {
    "timeseries": _timeseries,
    "stat": _stat,
    "bargauge": _bargauge,
    "status-history": _status_history,
    "state-timeline": _state_timeline,
}


def _legend() -> cb.VizLegendOptions:
    return (
        cb.VizLegendOptions()
        .calcs([])
        .display_mode(cm.LegendDisplayMode.LIST)
        .placement(cm.LegendPlacement.BOTTOM)
        .show_legend(True)
    )


def _single() -> cb.VizTooltipOptions:
    return cb.VizTooltipOptions().mode(cm.TooltipDisplayMode.SINGLE).sort(cm.SortOrder.NONE)


def _last() -> cb.ReduceDataOptions:
    return cb.ReduceDataOptions().calcs(["lastNotNull"]).fields("").values(False)


@dataclass(frozen=True, slots=True)
class Row:
    title: str


@dataclass(frozen=True, slots=True)
class Dashboard:
    uid: str
    title: str
    description: str
    items: tuple[Panel | Row, ...]

    def panels(self) -> Iterator[Panel]:
        return (item for item in self.items if isinstance(item, Panel))

    def build(self) -> db.Dashboard:
        board = (
            db.Dashboard(self.title)
            .uid(self.uid)
            .description(self.description)
            .editable()
            .tooltip(dm.DashboardCursorSync.CROSSHAIR)  # shared crosshair
            .link(_links())
            .refresh("30s")
            .tags([TAG])
            .time("now-6h", "now")
            .timezone("browser")
            .version(1)
        )
        for variable in _variables():
            board.with_variable(variable)
        for panel_id, item in enumerate(self.items, start=1):
            if isinstance(item, Row):
                board.with_row(db.Row(item.title).id(panel_id))
            else:
                board.with_panel(item.build(panel_id))
        return board

    def to_json(self) -> JSON:
        built = json.loads(JSONEncoder(sort_keys=True).encode(self.build().build()))
        return built  # type: ignore[no-any-return]


def _links() -> db.DashboardLink:
    return (
        db.DashboardLink("SparseGuard")
        .type(dm.DashboardLinkType.DASHBOARDS)
        .tags([TAG])
        .as_dropdown(True)
        .include_vars(True)
        .keep_time(True)
    )


def query_variable(name: str, label: str, query: str) -> db.QueryVariable:
    every = dm.VariableOption(selected=True, text=["All"], value=["$__all"])
    return (
        db.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(query)
        .include_all(True)
        .all_value(".*")
        .multi(True)
        .current(every)
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)  # new models and levels show up
        .sort(dm.VariableSort.ALPHABETICAL_ASC)
    )


def _variables() -> list[Any]:
    provisioned = dm.VariableOption(selected=True, text="Prometheus", value=PROVISIONED_DATASOURCE)
    source = db.DatasourceVariable("datasource").label("Data source").type("prometheus")
    return [
        source.current(provisioned),
        query_variable("model", "Model", "label_values(sparseguard_events_total, model)"),
        query_variable(
            "level", "Level", 'label_values(sparseguard_events_total{model=~"$model"}, level)'
        ),
    ]
