"""Real traffic through a gateway around the tiny engine into an aggregator on one broker and
one SQLite database, shared by the status-page and Prometheus-scrape tests."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry
from sqlalchemy.orm import Session, sessionmaker

from services.aggregator.alert_loop import AlertLoop
from services.aggregator.loop import Aggregator
from services.aggregator.metrics import AggregatorMetrics
from services.config import AlertSettings, EngineSettings, Settings, WebhookReceiver
from services.storage.db import make_engine, session_factory
from services.storage.repository import calibration_row, upsert_calibration
from services.telemetry.broker import Broker
from sparse_engine.calibration.baseline import run_prompts, summarise
from sparse_engine.calibration.store import CalibrationStore
from sparse_engine.data.traffic import Prompt
from sparse_engine.runtime.engine import Engine
from sparse_engine.sparsity.plan import Level
from tests.aggregator_fixtures import pipeline_settings
from tests.tiny import calibration_of

LEVELS = ("conservative", "balanced")
# Disjoint halves of send_traffic's questions: a healthy baseline's and the traffic's.
BASELINE_ROUNDS, TRAFFIC_ROUNDS = range(0, 60, 2), range(1, 60, 2)
MAX_TOKENS = 8  # send_traffic's answer length
TARGETS = {"conservative": 0.3, "balanced": 0.5, "aggressive": 0.7}  # tiny_engine()'s plans


def gate_band_rules(actions: Sequence[str] = ("webhook",)) -> str:
    """A rule that fires on this traffic: the tiny engine's conservative plan keeps ~0.97 of
    the activation magnitude (above the 0.75-0.92 band), its balanced plan ~0.89 (inside)."""
    return f"""
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
      summary: "Gate confidence out of band on {{{{ $labels.model }}}} ({{{{ $labels.level }}}})"
    actions: [{", ".join(actions)}]
"""


def traffic_settings(
    tmp_path: Path,
    broker: Broker,
    actions: Sequence[str] = ("webhook",),
    receivers: Sequence[WebhookReceiver] = (),
) -> Settings:
    """Gateway and aggregator on one SQLite database and one broker; snapshots and alert
    evaluations only when the test asks, and a KL drift measurement on every request."""
    rules = tmp_path / "rules.yaml"
    rules.write_text(gate_band_rules(actions))
    settings = pipeline_settings(tmp_path, broker.bootstrap, partitions=1)
    alerts = AlertSettings(
        rules_file=rules, evaluation_interval_s=3600.0, receivers=list(receivers)
    )
    quiet = {"snapshot_interval_s": 3600.0}
    return settings.model_copy(
        update={
            "alerts": alerts,
            "aggregator": settings.aggregator.model_copy(update=quiet),
            "engine": EngineSettings(drift_sample_rate=1.0),
        }
    )


def alerting_aggregator(settings: Settings) -> Aggregator:
    """An aggregator on the settings' database whose alert loop evaluates its rules."""
    sessions = session_factory(make_engine(settings.database_url))
    registry = CollectorRegistry()
    alerting = AlertLoop(settings.alerts, sessions, registry)
    return Aggregator(settings, sessions, AggregatorMetrics(registry), alerting=alerting)


def register_calibrations(sessions: sessionmaker[Session], engine: Engine) -> None:
    """The tiny engine's plans as calibration versions, so windows know their targets (made by
    uniform targets, so no held-out perplexity was measured)."""
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


def send_traffic(client: httpx.Client, rounds: range) -> set[str]:
    """Real chat requests at each level; returns the trace ids the gateway flagged."""
    flagged = set()
    for i in rounds:
        for level in LEVELS:
            body = {
                "messages": [{"role": "user", "content": f"Question {i}: what is sparsity?"}],
                "max_tokens": 8,
                "ir_sparse_level": level,
            }
            response = client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            if "action=none" not in response.headers["x-ir-trust"]:
                flagged.add(response.headers["x-ir-trace-id"])
    return flagged


def register_healthy_calibrations(settings: Settings, engine: Engine, store: bool = True) -> None:
    """The tiny engine's plans as calibrations, in SQL where the aggregator reads them and
    (`store`) in the store the gateway's reasons read, with baselines it measured on the
    other half of the traffic's questions (send_traffic's prompts)."""
    prompts = [Prompt("chat", f"Question {i}: what is sparsity?") for i in BASELINE_ROUNDS]
    sessions = session_factory(make_engine(settings.database_url))
    with sessions.begin() as session:
        for name in LEVELS:
            level = Level.parse(name)
            plan = engine.plan(level)
            assert plan.calibration_version is not None
            cal = calibration_of(engine, plan.calibration_version)
            cal.level, cal.target_sparsity = name, TARGETS[name]
            cal.realised_sparsity = TARGETS[name]
            cal.thresholds = {role: list(values) for role, values in plan.thresholds.items()}
            answers = run_prompts(engine, level, prompts, MAX_TOKENS)
            cal.baseline = summarise(level, prompts, answers, MAX_TOKENS).to_dict()
            if store:
                CalibrationStore(settings.calibrations_dir).save(cal)
            upsert_calibration(session, calibration_row(cal, "cli"))
