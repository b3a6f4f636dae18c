"""Real traffic through a gateway around the tiny engine into an aggregator on one broker and
one SQLite database, shared by the status-page and Prometheus-scrape tests."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import httpx
from sqlalchemy.orm import Session, sessionmaker

from services.config import AlertSettings, EngineSettings, Settings, WebhookReceiver
from services.storage.repository import upsert_calibration
from services.telemetry.broker import Broker
from sparse_engine.runtime.engine import Engine
from tests.aggregator_fixtures import pipeline_settings

LEVELS = ("conservative", "balanced")
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
