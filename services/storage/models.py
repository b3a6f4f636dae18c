"""The SQL schema as typed SQLAlchemy models: request summaries, window snapshots, calibrations,
alerts, the webhook outbox, job runs, model flags, golden-set runs and knowledge-base passages.
Every timestamp is timezone-aware UTC.

The tables are created by the Alembic migrations in `migrations/`, never from this metadata."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    Dialect,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

TRACE_ID_LENGTH = 64
FINGERPRINT_LENGTH = 64
CALIBRATION_REASONS = ("alert", "schedule", "operator", "cli")
ALERT_STATES = ("pending", "firing", "resolved")
DELIVERY_STATUSES = ("pending", "delivered", "failed", "disabled")
JOB_STATUSES = ("queued", "running", "succeeded", "failed")
GOLDEN_STATUSES = ("ok", "inconclusive", "over-budget")  # services.workers.golden_score

# Deterministic constraint names, so migrations (and SQLite batch rebuilds) can refer to them.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp stored as UTC and always read back timezone-aware in UTC. SQLite keeps no
    offset, so naive values would be ambiguous: binding one raises ValueError."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass a timezone-aware (UTC) datetime")
        utc = value.astimezone(UTC)
        return utc.replace(tzinfo=None) if dialect.name == "sqlite" else utc

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def one_of(column: str, values: tuple[str, ...]) -> CheckConstraint:
    allowed = ", ".join(f"'{value}'" for value in values)
    return CheckConstraint(f"{column} IN ({allowed})", name=column)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        datetime: UTCDateTime(),
        dict[str, Any]: JSON(),
    }


class RequestSummary(Base):
    """One request, as its telemetry event reported it; unique per trace id (replays dedupe)."""

    __tablename__ = "request_summaries"
    __table_args__ = (Index("ix_request_summaries_model_level_time", "model", "level", "time"),)

    # 64-bit: one row per request outgrows 2**31 in production. SQLite autoincrements only an
    # INTEGER primary key (its 64-bit rowid), so it keeps that type there.
    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    trace_id: Mapped[str] = mapped_column(String(TRACE_ID_LENGTH), unique=True)
    time: Mapped[datetime] = mapped_column(index=True)
    model: Mapped[str] = mapped_column(String)
    level: Mapped[str] = mapped_column(String)
    mode: Mapped[str] = mapped_column(String)
    api: Mapped[str] = mapped_column(String)
    status: Mapped[str] = mapped_column(String)
    calibration_version: Mapped[str | None] = mapped_column(String)
    partition: Mapped[int | None]
    offset: Mapped[int | None] = mapped_column(BigInteger)
    sparsity_ratio: Mapped[float | None] = mapped_column(Float)
    gate_confidence: Mapped[float | None] = mapped_column(Float)
    activation_stability_pct: Mapped[float | None] = mapped_column(Float)
    semantic_drift_kl: Mapped[float | None] = mapped_column(Float)
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    total_ms: Mapped[float | None] = mapped_column(Float)
    cache_hit_rate: Mapped[float | None] = mapped_column(Float)
    trust_score: Mapped[float | None] = mapped_column(Float)
    trust_action: Mapped[str | None] = mapped_column(String)
    prompt_tokens: Mapped[int] = mapped_column(default=0)
    completion_tokens: Mapped[int] = mapped_column(default=0)
    error_type: Mapped[str | None] = mapped_column(String)
    event: Mapped[dict[str, Any]]


class WindowSnapshot(Base):
    """The state of one rolling window (e.g. "5m", "1h", "24h") of one model and level."""

    __tablename__ = "window_snapshots"
    __table_args__ = (
        Index(
            "ix_window_snapshots_model_level_window_window_end",
            "model",
            "level",
            "window",
            "window_end",
        ),
    )

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    model: Mapped[str] = mapped_column(String)
    level: Mapped[str] = mapped_column(String)
    window: Mapped[str] = mapped_column(String(16))
    window_end: Mapped[datetime]
    taken_at: Mapped[datetime] = mapped_column(default=utcnow)
    data: Mapped[dict[str, Any]]


class CalibrationRecord(Base):
    """A calibration version: what it targeted, what it measured, and why it was made."""

    __tablename__ = "calibrations"
    __table_args__ = (one_of("reason", CALIBRATION_REASONS),)

    version: Mapped[str] = mapped_column(String, primary_key=True)
    model_id: Mapped[str] = mapped_column(String)
    level: Mapped[str] = mapped_column(String)
    weights_sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    target_sparsity: Mapped[float] = mapped_column(Float)
    realised_sparsity: Mapped[float | None] = mapped_column(Float)
    perplexity_change_pct: Mapped[float | None] = mapped_column(Float)
    reason: Mapped[str | None] = mapped_column(String(16))
    artefact: Mapped[dict[str, Any]]


class AlertRecord(Base):
    """One alert instance, keyed by the fingerprint of its labels."""

    __tablename__ = "alerts"
    __table_args__ = (one_of("state", ALERT_STATES),)

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    fingerprint: Mapped[str] = mapped_column(String(FINGERPRINT_LENGTH), index=True)
    name: Mapped[str] = mapped_column(String)
    state: Mapped[str] = mapped_column(String(16))
    severity: Mapped[str] = mapped_column(String(16))
    labels: Mapped[dict[str, Any]]
    annotations: Mapped[dict[str, Any]]
    value: Mapped[float | None] = mapped_column(Float)
    starts_at: Mapped[datetime]
    ends_at: Mapped[datetime | None]
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class WebhookDelivery(Base):
    """The transactional outbox of webhook notifications, one row per receiver and alert."""

    __tablename__ = "webhook_outbox"
    __table_args__ = (
        one_of("status", DELIVERY_STATUSES),
        Index("ix_webhook_outbox_status_next_attempt_at", "status", "next_attempt_at"),
    )

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    receiver: Mapped[str] = mapped_column(String)
    alert_fingerprint: Mapped[str] = mapped_column(String(FINGERPRINT_LENGTH))
    payload: Mapped[dict[str, Any]]
    status: Mapped[str] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(default=0)
    next_attempt_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_error: Mapped[str | None] = mapped_column(String)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    delivered_at: Mapped[datetime | None]


class JobRun(Base):
    """A background job (recalibrate, golden_check, ...) from queueing to its result."""

    __tablename__ = "job_runs"
    __table_args__ = (
        one_of("status", JOB_STATUSES),
        Index("ix_job_runs_kind_status", "kind", "status"),
    )

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16), default="queued")
    reason: Mapped[str] = mapped_column(String)
    trace_id: Mapped[str | None] = mapped_column(String(TRACE_ID_LENGTH))
    params: Mapped[dict[str, Any]]
    result: Mapped[dict[str, Any] | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    # Claims so far: a worker that died mid-task leaves "running", and the redelivered task
    # claims the job again.
    attempts: Mapped[int] = mapped_column(default=0, server_default="0")
    updated_at: Mapped[datetime | None] = mapped_column(default=utcnow, onupdate=utcnow)


class ModelFlag(Base):
    """A standing flag on a model, e.g. "finetune" when drift persists; cleared by deletion."""

    __tablename__ = "model_flags"

    model_id: Mapped[str] = mapped_column(String, primary_key=True)
    flag: Mapped[str] = mapped_column(String(32), primary_key=True)
    reason: Mapped[str] = mapped_column(String)
    details: Mapped[dict[str, Any]]
    set_at: Mapped[datetime] = mapped_column(default=utcnow)


class GoldenRun(Base):
    """One golden-set drift check: dense vs sparse answers under one calibration version,
    scored per item against external references (`metric`: the items' metrics joined by "+";
    "bleu-corpus" for runs stored before 0004, whose interval and status are None)."""

    __tablename__ = "golden_runs"
    __table_args__ = (
        Index("ix_golden_runs_model_id_level_created_at", "model_id", "level", "created_at"),
        one_of("status", GOLDEN_STATUSES),
    )

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    model_id: Mapped[str] = mapped_column(String)
    level: Mapped[str] = mapped_column(String)
    calibration_version: Mapped[str] = mapped_column(String)
    metric: Mapped[str] = mapped_column(String)
    score_dense: Mapped[float] = mapped_column(Float)  # mean per-item score, 0-100
    score_sparse: Mapped[float] = mapped_column(Float)
    drift: Mapped[float] = mapped_column(Float)  # mean paired difference, dense - sparse
    drift_low: Mapped[float | None] = mapped_column(Float)  # its bootstrap 95 % interval
    drift_high: Mapped[float | None] = mapped_column(Float)
    status: Mapped[str | None] = mapped_column(String(16))  # against the budget of the day
    kl_mean: Mapped[float] = mapped_column(Float)
    answers_changed: Mapped[int]
    prompts: Mapped[int]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    details: Mapped[dict[str, Any]]


class KBPassage(Base):
    """One knowledge-base passage for fallback retrieval, unique by the sha256 of its
    normalised text. Its full-text index (FTS5 `kb_fts` on SQLite, the generated `search`
    column on PostgreSQL) is maintained by the database and read by `services.storage.kb`."""

    __tablename__ = "kb_passages"

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    source: Mapped[str] = mapped_column(String)
    title: Mapped[str] = mapped_column(String, default="", server_default="")
    text: Mapped[str] = mapped_column(Text)
    digest: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
