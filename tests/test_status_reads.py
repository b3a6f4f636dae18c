"""The SQL reads behind the status page, on SQLite and PostgreSQL: the current snapshot per
key and window, the last hour's history, the latest state per alert, recent trust actions and
calibration versions."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from services.gateway.routes.status import trust_summaries
from services.storage import repository
from services.storage.db import make_engine, session_factory
from services.storage.models import AlertRecord
from services.storage.repository import insert_summaries, save_snapshots, upsert_calibration
from tests.status_fixtures import migrated_database


@pytest.fixture(params=["sqlite", "postgresql"])
def sessions(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sessionmaker[Session]]:
    with migrated_database(request.param, tmp_path) as url:
        engine = make_engine(url)
        yield session_factory(engine)
        engine.dispose()


def test_status_reads_pick_current_recent_and_latest_rows(
    sessions: sessionmaker[Session],
) -> None:
    t0 = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
    with sessions.begin() as session:
        save_snapshots(
            session,
            [
                _snapshot("m", level, window, t0 + timedelta(minutes=minute))
                for level in ("balanced", "aggressive")
                for window in ("5m", "1h")
                for minute in (0, 1, 2)
            ],
        )
        session.add_all(
            [
                _alert("a", "pending", t0),
                _alert("a", "firing", t0 + timedelta(seconds=30)),
                _alert("b", "resolved", t0 + timedelta(seconds=10)),
            ]
        )
        insert_summaries(
            session,
            [
                _summary("old-flag", t0 - timedelta(hours=2), "flag"),
                _summary("flag", t0, "flag"),
                _summary("none", t0, "none"),
                _summary("unset", t0, None),
            ],
        )
        for minute, version in enumerate(("v1", "v2")):
            upsert_calibration(session, _calibration(version, t0 + timedelta(minutes=minute)))
    since = t0 + timedelta(minutes=1)
    with sessions() as session:
        current = repository.current_snapshots(session, since)
        history = repository.snapshots_since(session, "5m", since)
        alerts = repository.recent_alerts(session)
        trust = repository.recent_trust_actions(session, t0 - timedelta(hours=1))
        scores = repository.trust_scores(session, t0 - timedelta(hours=1))
        calibrations = repository.recent_calibrations(session)
    assert [(s.level, s.window, s.window_end) for s in current] == [
        (level, window, t0 + timedelta(minutes=2))
        for level in ("aggressive", "balanced")
        for window in ("1h", "5m")
    ]
    assert [(s.level, s.window, s.taken_at.minute) for s in history] == [
        (level, "5m", minute) for level in ("aggressive", "balanced") for minute in (1, 2)
    ]
    assert [(a.fingerprint, a.state) for a in alerts] == [("a", "firing"), ("b", "resolved")]
    assert [row.trace_id for row in trust] == ["flag"]
    assert sorted(action for *_, action in scores) == ["flag", "none", "none"]  # unset: none
    summary = trust_summaries(scores, budget=0.05)
    assert [(t.requests, t.actions, t.histogram.count(0)) for t in summary] == [(3, 1, 9)]
    assert summary[0].action_rate == pytest.approx(1 / 3) and summary[0].budget == 0.05
    assert [c.version for c in calibrations] == ["v2", "v1"]


def _snapshot(model: str, level: str, window: str, at: datetime) -> dict[str, Any]:
    data = {"window": window, "requests": 1, "silence_rate_per_layer": [0.1, 0.2]}
    return {
        "model": model,
        "level": level,
        "window": window,
        "window_end": at,
        "taken_at": at,
        "data": data,
    }


def _alert(fingerprint: str, state: str, at: datetime) -> AlertRecord:
    return AlertRecord(
        fingerprint=fingerprint,
        name=f"Alert-{fingerprint}",
        state=state,
        severity="warning",
        labels={"model": "m"},
        annotations={},
        value=0.5,
        starts_at=at,
        ends_at=at if state == "resolved" else None,
        updated_at=at,
    )


def _summary(trace_id: str, at: datetime, action: str | None) -> dict[str, Any]:
    return {
        "trace_id": trace_id,
        "time": at,
        "model": "m",
        "level": "balanced",
        "mode": "serve",
        "api": "openai",
        "status": "ok",
        "trust_score": 0.2,
        "trust_action": action,
        "event": {"trace_id": trace_id},
    }


def _calibration(version: str, at: datetime) -> dict[str, Any]:
    return {
        "version": version,
        "model_id": "m",
        "level": "balanced",
        "weights_sha256": "ab" * 32,
        "created_at": at,
        "target_sparsity": 0.5,
        "reason": "cli",
        "artefact": {"thresholds": [0.1]},
    }
