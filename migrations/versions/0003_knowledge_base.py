"""Knowledge base: passages for fallback retrieval, with a full-text index per dialect.

`kb_passages` holds the passages, unique by the sha256 of their normalised text. SQLite indexes
them in an FTS5 external-content table `kb_fts` (porter stemming) kept in sync by triggers;
PostgreSQL in a stored generated `search` tsvector column with a GIN index.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-06 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The standard FTS5 external-content pattern: the index stores no text of its own, so every
# change to kb_passages is mirrored, and a removal must pass the old values ('delete').
SQLITE_FTS = (
    "CREATE VIRTUAL TABLE kb_fts USING fts5(title, text, content='kb_passages', "
    "content_rowid='id', tokenize='porter unicode61')",
    "CREATE TRIGGER kb_passages_ai AFTER INSERT ON kb_passages BEGIN "
    "INSERT INTO kb_fts(rowid, title, text) VALUES (new.id, new.title, new.text); END",
    "CREATE TRIGGER kb_passages_ad AFTER DELETE ON kb_passages BEGIN "
    "INSERT INTO kb_fts(kb_fts, rowid, title, text) "
    "VALUES ('delete', old.id, old.title, old.text); END",
    "CREATE TRIGGER kb_passages_au AFTER UPDATE ON kb_passages BEGIN "
    "INSERT INTO kb_fts(kb_fts, rowid, title, text) "
    "VALUES ('delete', old.id, old.title, old.text); "
    "INSERT INTO kb_fts(rowid, title, text) VALUES (new.id, new.title, new.text); END",
)
SQLITE_FTS_DROP = (
    "DROP TRIGGER IF EXISTS kb_passages_au",
    "DROP TRIGGER IF EXISTS kb_passages_ad",
    "DROP TRIGGER IF EXISTS kb_passages_ai",
    "DROP TABLE IF EXISTS kb_fts",
)
POSTGRES_SEARCH = (
    "ALTER TABLE kb_passages ADD COLUMN search tsvector GENERATED ALWAYS AS "
    "(to_tsvector('english', coalesce(title, '') || ' ' || text)) STORED"
)


def upgrade() -> None:
    op.create_table(
        "kb_passages",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("source", sa.String(), nullable=False),
        sa.Column("title", sa.String(), nullable=False, server_default=""),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_kb_passages")),
        sa.UniqueConstraint("digest", name=op.f("uq_kb_passages_digest")),
    )
    dialect = op.get_bind().dialect.name
    if dialect == "sqlite":
        for statement in SQLITE_FTS:
            op.execute(statement)
    elif dialect == "postgresql":
        op.execute(POSTGRES_SEARCH)
        op.create_index("ix_kb_passages_search", "kb_passages", ["search"], postgresql_using="gin")


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect == "sqlite":
        for statement in SQLITE_FTS_DROP:
            op.execute(statement)
    elif dialect == "postgresql":
        op.drop_index("ix_kb_passages_search", table_name="kb_passages")
    op.drop_table("kb_passages")
