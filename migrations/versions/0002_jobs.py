"""Jobs: claim attempts on job runs, and per-model flags (the fine-tune flag).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("job_runs") as batch:
        batch.add_column(sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("updated_at", sa.DateTime(timezone=True), nullable=True))
    op.create_table(
        "model_flags",
        sa.Column("model_id", sa.String(), nullable=False),
        sa.Column("flag", sa.String(length=32), nullable=False),
        sa.Column("reason", sa.String(), nullable=False),
        sa.Column("details", sa.JSON(), nullable=False),
        sa.Column("set_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("model_id", "flag", name=op.f("pk_model_flags")),
    )


def downgrade() -> None:
    op.drop_table("model_flags")
    with op.batch_alter_table("job_runs") as batch:
        batch.drop_column("updated_at")
        batch.drop_column("attempts")
