"""Golden runs score against external references: per-level drift in points of the items'
metrics with a paired-bootstrap interval and a status.

`bleu_dense`, `bleu_sparse` and `drift_bleu` become `score_dense`, `score_sparse` and `drift`
(the values of earlier runs are kept; their `metric` is 'bleu-corpus', corpus BLEU-4 against
dense-model references). New: `metric`, `drift_low` and `drift_high` (the 95 % interval; None
for earlier runs) and `status` ('ok', 'inconclusive', 'over-budget'; None for earlier runs).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-08 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

RENAMES = (("bleu_dense", "score_dense"), ("bleu_sparse", "score_sparse"), ("drift_bleu", "drift"))
LEGACY_METRIC = "bleu-corpus"
STATUS_CHECK = "status IN ('ok', 'inconclusive', 'over-budget')"


def upgrade() -> None:
    with op.batch_alter_table("golden_runs") as batch:
        for old, new in RENAMES:
            batch.alter_column(old, new_column_name=new)
        batch.add_column(sa.Column("metric", sa.String(), nullable=True))
        batch.add_column(sa.Column("drift_low", sa.Float(), nullable=True))
        batch.add_column(sa.Column("drift_high", sa.Float(), nullable=True))
        batch.add_column(sa.Column("status", sa.String(length=16), nullable=True))
    op.execute(sa.text(f"UPDATE golden_runs SET metric = '{LEGACY_METRIC}'"))
    with op.batch_alter_table("golden_runs") as batch:
        batch.alter_column("metric", existing_type=sa.String(), nullable=False)
        batch.create_check_constraint(op.f("ck_golden_runs_status"), STATUS_CHECK)


def downgrade() -> None:
    with op.batch_alter_table("golden_runs") as batch:
        batch.drop_constraint(op.f("ck_golden_runs_status"), type_="check")
        for column in ("status", "drift_high", "drift_low", "metric"):
            batch.drop_column(column)
        for old, new in RENAMES:
            batch.alter_column(new, new_column_name=old)
