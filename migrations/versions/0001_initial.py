"""Initial schema: every SparseGuard table.

Request summaries, window snapshots, calibrations, alerts, the webhook outbox, job runs and
golden runs. Timestamps are stored in UTC (TIMESTAMP WITH TIME ZONE on PostgreSQL, naive UTC
text on SQLite).

Revision ID: 0001
Revises:
Create Date: 2026-01-01 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "alerts",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("severity", sa.String(length=16), nullable=False),
        sa.Column("labels", sa.JSON(), nullable=False),
        sa.Column("annotations", sa.JSON(), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("starts_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ends_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "state IN ('pending', 'firing', 'resolved')", name=op.f("ck_alerts_state")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_alerts")),
    )
    op.create_index(op.f("ix_alerts_fingerprint"), "alerts", ["fingerprint"], unique=False)
    op.create_table(
        "calibrations",
        sa.Column("version", sa.String(), nullable=False),
        sa.Column("model_id", sa.String(), nullable=False),
        sa.Column("level", sa.String(), nullable=False),
        sa.Column("weights_sha256", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("target_sparsity", sa.Float(), nullable=False),
        sa.Column("realised_sparsity", sa.Float(), nullable=True),
        sa.Column("perplexity_change_pct", sa.Float(), nullable=True),
        sa.Column("reason", sa.String(length=16), nullable=True),
        sa.Column("artefact", sa.JSON(), nullable=False),
        sa.CheckConstraint(
            "reason IN ('alert', 'schedule', 'operator', 'cli')",
            name=op.f("ck_calibrations_reason"),
        ),
        sa.PrimaryKeyConstraint("version", name=op.f("pk_calibrations")),
    )
    op.create_table(
        "golden_runs",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("model_id", sa.String(), nullable=False),
        sa.Column("level", sa.String(), nullable=False),
        sa.Column("calibration_version", sa.String(), nullable=False),
        sa.Column("bleu_dense", sa.Float(), nullable=False),
        sa.Column("bleu_sparse", sa.Float(), nullable=False),
        sa.Column("drift_bleu", sa.Float(), nullable=False),
        sa.Column("kl_mean", sa.Float(), nullable=False),
        sa.Column("answers_changed", sa.Integer(), nullable=False),
        sa.Column("prompts", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("details", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_golden_runs")),
    )
    op.create_index(
        "ix_golden_runs_model_id_level_created_at",
        "golden_runs",
        ["model_id", "level", "created_at"],
        unique=False,
    )
    op.create_table(
        "job_runs",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.String(), nullable=False),
        sa.Column("trace_id", sa.String(length=64), nullable=True),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "status IN ('queued', 'running', 'succeeded', 'failed')",
            name=op.f("ck_job_runs_status"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job_runs")),
    )
    op.create_index("ix_job_runs_kind_status", "job_runs", ["kind", "status"], unique=False)
    op.create_table(
        "request_summaries",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("trace_id", sa.String(length=64), nullable=False),
        sa.Column("time", sa.DateTime(timezone=True), nullable=False),
        sa.Column("model", sa.String(), nullable=False),
        sa.Column("level", sa.String(), nullable=False),
        sa.Column("mode", sa.String(), nullable=False),
        sa.Column("api", sa.String(), nullable=False),
        sa.Column("status", sa.String(), nullable=False),
        sa.Column("calibration_version", sa.String(), nullable=True),
        sa.Column("partition", sa.Integer(), nullable=True),
        sa.Column("offset", sa.BigInteger(), nullable=True),
        sa.Column("sparsity_ratio", sa.Float(), nullable=True),
        sa.Column("gate_confidence", sa.Float(), nullable=True),
        sa.Column("activation_stability_pct", sa.Float(), nullable=True),
        sa.Column("semantic_drift_kl", sa.Float(), nullable=True),
        sa.Column("ttft_ms", sa.Float(), nullable=True),
        sa.Column("total_ms", sa.Float(), nullable=True),
        sa.Column("cache_hit_rate", sa.Float(), nullable=True),
        sa.Column("trust_score", sa.Float(), nullable=True),
        sa.Column("trust_action", sa.String(), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("error_type", sa.String(), nullable=True),
        sa.Column("event", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_request_summaries")),
        sa.UniqueConstraint("trace_id", name=op.f("uq_request_summaries_trace_id")),
    )
    op.create_index(
        "ix_request_summaries_model_level_time",
        "request_summaries",
        ["model", "level", "time"],
        unique=False,
    )
    op.create_index(op.f("ix_request_summaries_time"), "request_summaries", ["time"], unique=False)
    op.create_table(
        "webhook_outbox",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("receiver", sa.String(), nullable=False),
        sa.Column("alert_fingerprint", sa.String(length=64), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_error", sa.String(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("delivered_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "status IN ('pending', 'delivered', 'failed', 'disabled')",
            name=op.f("ck_webhook_outbox_status"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_webhook_outbox")),
    )
    op.create_index(
        "ix_webhook_outbox_status_next_attempt_at",
        "webhook_outbox",
        ["status", "next_attempt_at"],
        unique=False,
    )
    op.create_table(
        "window_snapshots",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("model", sa.String(), nullable=False),
        sa.Column("level", sa.String(), nullable=False),
        sa.Column("window", sa.String(length=16), nullable=False),
        sa.Column("window_end", sa.DateTime(timezone=True), nullable=False),
        sa.Column("taken_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_window_snapshots")),
    )
    op.create_index(
        "ix_window_snapshots_model_level_window_window_end",
        "window_snapshots",
        ["model", "level", "window", "window_end"],
        unique=False,
    )


def downgrade() -> None:
    op.drop_index(
        "ix_window_snapshots_model_level_window_window_end", table_name="window_snapshots"
    )
    op.drop_table("window_snapshots")
    op.drop_index("ix_webhook_outbox_status_next_attempt_at", table_name="webhook_outbox")
    op.drop_table("webhook_outbox")
    op.drop_index(op.f("ix_request_summaries_time"), table_name="request_summaries")
    op.drop_index("ix_request_summaries_model_level_time", table_name="request_summaries")
    op.drop_table("request_summaries")
    op.drop_index("ix_job_runs_kind_status", table_name="job_runs")
    op.drop_table("job_runs")
    op.drop_index("ix_golden_runs_model_id_level_created_at", table_name="golden_runs")
    op.drop_table("golden_runs")
    op.drop_table("calibrations")
    op.drop_index(op.f("ix_alerts_fingerprint"), table_name="alerts")
    op.drop_table("alerts")
