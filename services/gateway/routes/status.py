"""The status page: GET /status serves the page (static, public, holds no data) and GET
/status/data what it shows (admin key when keys are configured), read from SQL: the current
windows, the last hour of 5-minute windows as series (sparsity, gate confidence, KL drift,
per-layer silence), recent alerts and trust actions, calibration versions, each level's latest
golden-set check (drift, interval and status: ok, inconclusive or over-budget), and the
versions this gateway serves now."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from functools import cache
from importlib.resources import files
from typing import Any

from fastapi import APIRouter, Response
from fastapi.responses import HTMLResponse
from pydantic import BaseModel, ConfigDict
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from alerts.definitions import Rule
from alerts.rules import DEFAULT_RULES, load_rules
from services.aggregator.windows import WINDOWS
from services.config import Settings
from services.gateway.deps import AdminDep, RuntimeDep
from services.gateway.errors import ApiError
from services.gateway.status_marks import window_marks
from services.storage import repository
from services.storage.models import AlertRecord, WindowSnapshot

log = logging.getLogger(__name__)
router = APIRouter(prefix="/status")

SERIES_WINDOW = "5m"
SERIES_SPAN = timedelta(hours=1)
QUANTILES = (5, 25, 50, 75, 95)
RECENT_SPAN = timedelta(hours=24)  # windows and trust actions older than this are not shown
NO_SNAPSHOTS = (
    "No window snapshots in SQL yet. Run the aggregator (`sparseguard aggregator`) on this "
    "database and send traffic: it stores the windows every minute."
)
# The page is static and never holds data or keys; it may only talk back to this gateway.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
    "style-src 'unsafe-inline'; connect-src 'self'; frame-ancestors 'none'",
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
}


class WindowRow(BaseModel):
    model: str
    level: str
    window: str
    window_end: datetime
    taken_at: datetime
    requests: int
    error_rate: float
    sparsity_mean: float | None
    sparsity_target: float | None
    gate_confidence_mean: float | None
    drift_kl_mean: float | None
    late_silence_mean: float | None
    layer_sparsity_shift: float | None  # standard errors beyond a layer's tolerance
    signal_spread_ratio: float | None  # the requests' spread against healthy traffic's
    cache_hit_rate_mean: float | None
    latency_p50_ms: float | None
    latency_p99_ms: float | None
    calibration_version: str | None
    # Metric -> "bad" where the window's alert rule holds (services/gateway/status_marks.py).
    marks: dict[str, str] = {}


class Point(BaseModel):
    t: datetime  # when the snapshot was taken
    sparsity: float | None
    sparsity_target: float | None
    gate_confidence: float | None
    drift_kl: float | None
    silence: list[float]  # per layer


class Series(BaseModel):
    model: str
    level: str
    points: list[Point]


class AlertView(BaseModel):
    name: str
    state: str
    severity: str
    labels: dict[str, Any]
    summary: str | None
    value: float | None
    starts_at: datetime
    ends_at: datetime | None


class TrustActionView(BaseModel):
    model_config = ConfigDict(from_attributes=True)
    time: datetime
    trace_id: str
    model: str
    level: str
    trust_score: float | None
    trust_action: str


class TrustSummary(BaseModel):
    """One key's trust scores over the last 24 h: how they spread (ten bins over [0, 1],
    quartiles) and the share of answers with an action against the flag budget."""

    model: str
    level: str
    requests: int
    actions: int
    action_rate: float
    budget: float
    quantiles: dict[str, float]  # p5, p25, p50, p75, p95
    histogram: list[int]  # counts per tenth of [0, 1]


class CalibrationView(BaseModel):
    model_config = ConfigDict(from_attributes=True)
    version: str
    model_id: str
    level: str
    created_at: datetime
    target_sparsity: float
    realised_sparsity: float | None
    perplexity_change_pct: float | None
    reason: str | None


class GoldenView(BaseModel):
    model_config = ConfigDict(from_attributes=True)
    model_id: str
    level: str
    calibration_version: str
    created_at: datetime
    metric: str
    drift: float  # points of the golden metric, dense - sparse
    drift_low: float | None
    drift_high: float | None
    status: str | None  # ok | inconclusive | over-budget
    answers_changed: int
    prompts: int
    kl_mean: float


class Serving(BaseModel):
    model: str
    mode: str
    levels: dict[str, str | None]  # level -> calibration version


class StatusData(BaseModel):
    generated_at: datetime
    message: str | None  # why there is nothing to show yet
    gate_band: tuple[float, float]
    spike_silence: float  # the late-layer silence of a spike, for the heat maps' legend
    serving: Serving
    windows: list[WindowRow]
    series: list[Series]
    alerts: list[AlertView]
    trust_actions: list[TrustActionView]
    trust: list[TrustSummary]
    calibrations: list[CalibrationView]
    golden: list[GoldenView]


@router.get("", response_class=HTMLResponse, include_in_schema=False)
def status_page() -> HTMLResponse:
    return HTMLResponse(_page(), headers=PAGE_HEADERS)


# A plain `def`: SQL is a blocking client, run in a thread.
@router.get("/data")
def status_data(rt: RuntimeDep, _: AdminDep, response: Response) -> StatusData:
    """What the status page shows; `message` says why it is empty, when it is."""
    response.headers["Cache-Control"] = "no-store"
    now = datetime.now(UTC)
    serving = Serving(
        model=rt.engine.lm.model_id,
        mode=rt.settings.gateway.mode,
        levels={level.value: plan.calibration_version for level, plan in rt.engine.plans.items()},
    )
    try:
        sessions, _celery = rt.jobs.open()
        with sessions() as session:
            return _read(session, now, serving, rt.settings)
    except SQLAlchemyError:
        log.exception("status data: the database could not be read")
        raise ApiError(503, "the status database cannot be read; see the gateway log") from None


def trust_summaries(rows: list[tuple[str, str, float, str]], budget: float) -> list[TrustSummary]:
    keyed: dict[tuple[str, str], list[tuple[float, str]]] = {}
    for model, level, score, action in rows:
        keyed.setdefault((model, level), []).append((score, action))
    out = []
    for (model, level), found in sorted(keyed.items()):
        scores = sorted(score for score, _ in found)
        actions = sum(action != "none" for _, action in found)
        bins = [0] * 10
        for score in scores:
            bins[min(9, max(0, int(score * 10)))] += 1
        quantile = {
            f"p{q}": scores[min(len(scores) - 1, q * len(scores) // 100)] for q in QUANTILES
        }
        out.append(
            TrustSummary(
                model=model,
                level=level,
                requests=len(found),
                actions=actions,
                action_rate=actions / len(found),
                budget=budget,
                quantiles=quantile,
                histogram=bins,
            )
        )
    return out


def _read(session: Session, now: datetime, serving: Serving, settings: Settings) -> StatusData:
    signals = settings.signals
    current = repository.current_snapshots(session, now - RECENT_SPAN)
    rules = load_rules(settings.alerts.rules_file or DEFAULT_RULES, signals.as_thresholds())
    windows = sorted((_window_row(s, rules) for s in current), key=_window_order)
    history = repository.snapshots_since(session, SERIES_WINDOW, now - SERIES_SPAN)
    trust = repository.recent_trust_actions(session, now - RECENT_SPAN)
    return StatusData(
        generated_at=now,
        message=None if windows else NO_SNAPSHOTS,
        gate_band=signals.gate_band,
        spike_silence=signals.spike_silence,
        serving=serving,
        windows=windows,
        series=_series(history),
        alerts=[_alert(a) for a in repository.recent_alerts(session)],
        trust_actions=[TrustActionView.model_validate(row) for row in trust],
        trust=trust_summaries(
            repository.trust_scores(session, now - RECENT_SPAN), settings.trust.flag_budget
        ),
        calibrations=[
            CalibrationView.model_validate(c) for c in repository.recent_calibrations(session)
        ],
        golden=[GoldenView.model_validate(g) for g in repository.latest_golden_runs(session)],
    )


def _window_row(snapshot: WindowSnapshot, rules: list[Rule]) -> WindowRow:
    data = snapshot.data
    labels = {"model": snapshot.model, "level": snapshot.level, "window": snapshot.window}
    latency = data.get("latency_ms") or {}
    return WindowRow(
        model=snapshot.model,
        level=snapshot.level,
        window=snapshot.window,
        window_end=snapshot.window_end,
        taken_at=snapshot.taken_at,
        requests=data.get("requests", 0),
        error_rate=data.get("error_rate", 0.0),
        sparsity_mean=data.get("sparsity_mean"),
        sparsity_target=data.get("sparsity_target"),
        gate_confidence_mean=data.get("gate_confidence_mean"),
        drift_kl_mean=data.get("drift_kl_mean"),
        late_silence_mean=data.get("late_silence_mean"),
        layer_sparsity_shift=data.get("layer_sparsity_shift"),
        signal_spread_ratio=data.get("signal_spread_ratio"),
        cache_hit_rate_mean=data.get("cache_hit_rate_mean"),
        latency_p50_ms=latency.get("p50"),
        latency_p99_ms=latency.get("p99"),
        calibration_version=data.get("calibration_version"),
        marks=window_marks(labels, data, rules),
    )


def _window_order(row: WindowRow) -> tuple[str, str, int]:
    order = list(WINDOWS)  # 5m, 1h, 24h
    return row.model, row.level, order.index(row.window) if row.window in order else len(order)


def _series(snapshots: list[WindowSnapshot]) -> list[Series]:
    """One series per (model, level), in the snapshots' order (oldest first)."""
    by_key: dict[tuple[str, str], list[Point]] = {}
    for s in snapshots:
        point = Point(
            t=s.taken_at,
            sparsity=s.data.get("sparsity_mean"),
            sparsity_target=s.data.get("sparsity_target"),
            gate_confidence=s.data.get("gate_confidence_mean"),
            drift_kl=s.data.get("drift_kl_mean"),
            silence=s.data.get("silence_rate_per_layer") or [],
        )
        by_key.setdefault((s.model, s.level), []).append(point)
    return [Series(model=m, level=lv, points=points) for (m, lv), points in by_key.items()]


def _alert(row: AlertRecord) -> AlertView:
    summary = row.annotations.get("summary")
    return AlertView(
        name=row.name,
        state=row.state,
        severity=row.severity,
        labels=row.labels,
        summary=summary if isinstance(summary, str) else None,
        value=row.value,
        starts_at=row.starts_at,
        ends_at=row.ends_at,
    )


@cache
def _page() -> str:
    return files("services.gateway").joinpath("status_page/index.html").read_text("utf-8")
