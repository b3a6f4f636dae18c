"""Reads and writes the aggregator, alerts and jobs share, as plain functions of a `Session`.
They never commit: the caller owns the transaction (`with factory.begin() as session: ...`)."""

from __future__ import annotations

import math
from collections.abc import Collection
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, defer

from services.storage.models import (
    TRACE_ID_LENGTH,
    AlertRecord,
    Base,
    CalibrationRecord,
    GoldenRun,
    JobRun,
    ModelFlag,
    RequestSummary,
    WindowSnapshot,
)
from sparse_engine.calibration.store import Calibration


def _insert(session: Session, entity: type[Base]) -> postgresql.Insert | sqlite.Insert:
    """The dialect's INSERT, which has ON CONFLICT (the generic one does not)."""
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        return postgresql.insert(entity)
    if dialect == "sqlite":
        return sqlite.insert(entity)
    raise ValueError(f"unsupported database dialect {dialect!r}: use SQLite or PostgreSQL")


def _finite(row: dict[str, Any]) -> dict[str, Any]:
    """NaN and infinities stored as NULL (missing), as the window fold treats them: SQLite
    would turn NaN into NULL but PostgreSQL keeps it, and one NaN poisons every AVG()."""
    return {
        key: None if isinstance(value, float) and not math.isfinite(value) else value
        for key, value in row.items()
    }


def _first_per_trace(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with a valid trace id, the first of each trace id kept (in-batch replays)."""
    unique: dict[str, dict[str, Any]] = {}
    for row in rows:
        trace_id = row.get("trace_id")
        if not isinstance(trace_id, str) or not 0 < len(trace_id) <= TRACE_ID_LENGTH:
            raise ValueError(f"trace_id must be 1-{TRACE_ID_LENGTH} characters, got {trace_id!r}")
        if trace_id not in unique:
            unique[trace_id] = _finite(row)
    return list(unique.values())


def insert_summaries(session: Session, rows: list[dict[str, Any]]) -> set[str]:
    """Insert request summaries, skipping trace ids already stored or repeated in `rows` (the
    first one wins); returns the trace ids that were new, so a replay never counts twice.
    Raises ValueError for a trace id the column cannot hold (empty or over 64 characters)."""
    unique = _first_per_trace(rows)
    if not unique:
        return set()
    statement = (
        _insert(session, RequestSummary)
        .on_conflict_do_nothing(index_elements=[RequestSummary.trace_id])
        .returning(RequestSummary.trace_id)
    )
    return set(session.scalars(statement, unique))


def summaries_since(
    session: Session, since: datetime, partitions: set[int] | None = None
) -> list[RequestSummary]:
    """Summaries with `time >= since`, oldest first; only those partitions when given."""
    statement = select(RequestSummary).where(RequestSummary.time >= since)
    if partitions is not None:
        statement = statement.where(RequestSummary.partition.in_(partitions))
    return list(session.scalars(statement.order_by(RequestSummary.time, RequestSummary.id)))


def save_snapshots(session: Session, rows: list[dict[str, Any]]) -> None:
    session.add_all(WindowSnapshot(**row) for row in rows)
    session.flush()


def upsert_calibration(session: Session, record: dict[str, Any]) -> None:
    """Insert a calibration version, or overwrite every field of the stored one."""
    statement = _insert(session, CalibrationRecord).values(**record)
    updates = {key: statement.excluded[key] for key in record if key != "version"}
    if updates:
        statement = statement.on_conflict_do_update(
            index_elements=[CalibrationRecord.version], set_=updates
        )
    else:
        statement = statement.on_conflict_do_nothing(index_elements=[CalibrationRecord.version])
    session.execute(statement)


def calibration_row(cal: Calibration, reason: str) -> dict[str, Any]:
    """The calibrations table row of an artefact, with why it was made."""
    return {
        "version": cal.version,
        "model_id": cal.model_id,
        "level": cal.level,
        "weights_sha256": cal.weights_sha256,
        "created_at": datetime.fromisoformat(cal.created_at),
        "target_sparsity": cal.target_sparsity,
        "realised_sparsity": cal.realised_sparsity,
        "perplexity_change_pct": cal.perplexity_change_pct,
        "reason": reason,
        "artefact": cal.to_dict(),
    }


def calibration_targets(session: Session) -> dict[str, float]:
    """Calibration version -> the sparsity it targeted."""
    rows = session.execute(select(CalibrationRecord.version, CalibrationRecord.target_sparsity))
    return {version: target for version, target in rows}


def calibration_baselines(
    session: Session, known: Collection[str] = ()
) -> dict[str, dict[str, Any] | None]:
    """Calibration version -> its artefact's healthy baseline (None if it has none), for the
    versions not in `known` (a baseline, once measured, never changes)."""
    query = select(CalibrationRecord.version, CalibrationRecord.artefact)
    if known:
        query = query.where(CalibrationRecord.version.not_in(list(known)))
    return {version: artefact.get("baseline") for version, artefact in session.execute(query)}


def set_flag(
    session: Session, model_id: str, flag: str, reason: str, details: dict[str, Any]
) -> None:
    """Raise a standing flag on a model (e.g. "finetune"); raising it again updates it."""
    row = {
        "model_id": model_id,
        "flag": flag,
        "reason": reason,
        "details": details,
        "set_at": datetime.now(UTC),
    }
    statement = _insert(session, ModelFlag).values(**row)
    session.execute(
        statement.on_conflict_do_update(
            index_elements=[ModelFlag.model_id, ModelFlag.flag],
            set_={key: statement.excluded[key] for key in ("reason", "details", "set_at")},
        )
    )


def flags(session: Session, model_id: str | None = None) -> list[ModelFlag]:
    statement = select(ModelFlag).order_by(ModelFlag.model_id, ModelFlag.flag)
    if model_id is not None:
        statement = statement.where(ModelFlag.model_id == model_id)
    return list(session.scalars(statement))


def golden_runs_since(session: Session, since: datetime) -> list[GoldenRun]:
    """Golden-set runs created at or after `since`, oldest first."""
    statement = select(GoldenRun).where(GoldenRun.created_at >= since)
    return list(session.scalars(statement.order_by(GoldenRun.created_at, GoldenRun.id)))


def last_golden_run_at(session: Session) -> datetime | None:
    return session.scalar(select(func.max(GoldenRun.created_at)))


def latest_golden_runs(session: Session) -> list[GoldenRun]:
    """The newest golden-set run of each (model, level), by model and level."""
    newest = select(func.max(GoldenRun.id)).group_by(GoldenRun.model_id, GoldenRun.level)
    statement = select(GoldenRun).where(GoldenRun.id.in_(newest), GoldenRun.drift_low.is_not(None))
    return list(session.scalars(statement.order_by(GoldenRun.model_id, GoldenRun.level)))


def first_calibration_at(session: Session) -> datetime | None:
    return session.scalar(select(func.min(CalibrationRecord.created_at)))


def job_counts(session: Session) -> dict[tuple[str, str], int]:
    """(kind, status) -> number of job runs."""
    rows = session.execute(
        select(JobRun.kind, JobRun.status, func.count()).group_by(JobRun.kind, JobRun.status)
    )
    return {(kind, status): count for kind, status, count in rows}


def current_snapshots(session: Session, since: datetime) -> list[WindowSnapshot]:
    """The newest snapshot of every (model, level, window) whose window ends at or after
    `since` (older keys are gone), ordered by model, level and window."""
    keys = (WindowSnapshot.model, WindowSnapshot.level, WindowSnapshot.window)
    ranked = (
        select(
            WindowSnapshot.id,
            func.row_number()
            .over(
                partition_by=keys,
                order_by=(
                    WindowSnapshot.window_end.desc(),
                    WindowSnapshot.taken_at.desc(),
                    WindowSnapshot.id.desc(),
                ),
            )
            .label("rank"),
        ).where(WindowSnapshot.window_end >= since)
    ).subquery()
    statement = (
        select(WindowSnapshot)
        .join(ranked, ranked.c.id == WindowSnapshot.id)
        .where(ranked.c.rank == 1)
        .order_by(*keys)
    )
    return list(session.scalars(statement))


def snapshots_since(session: Session, window: str, since: datetime) -> list[WindowSnapshot]:
    """Every snapshot of `window` taken at or after `since`, per model and level, oldest first."""
    statement = (
        select(WindowSnapshot)
        .where(WindowSnapshot.window == window, WindowSnapshot.taken_at >= since)
        .order_by(
            WindowSnapshot.model, WindowSnapshot.level, WindowSnapshot.taken_at, WindowSnapshot.id
        )
    )
    return list(session.scalars(statement))


def recent_alerts(session: Session, limit: int = 20) -> list[AlertRecord]:
    """The latest state of each alert (by fingerprint), most recently changed first."""
    ranked = (
        select(
            AlertRecord.id,
            func.row_number()
            .over(
                partition_by=AlertRecord.fingerprint,
                order_by=(AlertRecord.updated_at.desc(), AlertRecord.id.desc()),
            )
            .label("rank"),
        )
    ).subquery()
    statement = (
        select(AlertRecord)
        .join(ranked, ranked.c.id == AlertRecord.id)
        .where(ranked.c.rank == 1)
        .order_by(AlertRecord.updated_at.desc(), AlertRecord.id.desc())
        .limit(limit)
    )
    return list(session.scalars(statement))


def recent_trust_actions(
    session: Session, since: datetime, limit: int = 20
) -> list[RequestSummary]:
    """Requests since `since` whose trust decision was an action (not "none"), newest first."""
    statement = (
        select(RequestSummary)
        .options(defer(RequestSummary.event))
        .where(
            RequestSummary.time >= since,
            RequestSummary.trust_action.is_not(None),
            RequestSummary.trust_action != "none",
        )
        .order_by(RequestSummary.time.desc(), RequestSummary.id.desc())
        .limit(limit)
    )
    return list(session.scalars(statement))


def trust_scores(
    session: Session, since: datetime, limit: int = 5000
) -> list[tuple[str, str, float, str]]:
    """(model, level, trust score, action) of the latest scored requests since `since`."""
    statement = (
        select(
            RequestSummary.model,
            RequestSummary.level,
            RequestSummary.trust_score,
            RequestSummary.trust_action,
        )
        .where(RequestSummary.time >= since, RequestSummary.trust_score.is_not(None))
        .order_by(RequestSummary.time.desc(), RequestSummary.id.desc())
        .limit(limit)
    )
    rows = session.execute(statement)
    return [(m, lv, float(score or 0.0), action or "none") for m, lv, score, action in rows]


def recent_calibrations(session: Session, limit: int = 20) -> list[CalibrationRecord]:
    """Calibration versions, newest first, without their (large) artefacts."""
    statement = (
        select(CalibrationRecord)
        .options(defer(CalibrationRecord.artefact))
        .order_by(CalibrationRecord.created_at.desc(), CalibrationRecord.version)
        .limit(limit)
    )
    return list(session.scalars(statement))
