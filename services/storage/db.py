"""Engines, sessions and migrations: `make_engine(url)` for SQLite (embedded) or PostgreSQL
(distributed), `session_factory(engine)`, and `upgrade(url)` / `current_revision(url)`, which
run the Alembic migrations in `migrations/` — the only way the schema is created."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import URL, Engine, create_engine, event, make_url
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"
POSTGRES_DRIVER = "postgresql+psycopg"
# Several embedded processes (aggregator, worker, beat) write one SQLite file: wait for locks.
SQLITE_BUSY_TIMEOUT_S = 30.0


def normalize_url(url: str) -> URL:
    """The URL with a bare `postgresql://` (or `postgres://`) mapped to the psycopg 3 driver."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        return parsed.set(drivername=POSTGRES_DRIVER)
    return parsed


def masked_url(url: str) -> str:
    """The URL for logs and output: any password replaced by `***`."""
    return normalize_url(url).render_as_string(hide_password=True)


def make_engine(url: str) -> Engine:
    parsed = normalize_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        return _sqlite_engine(parsed)
    if backend == "postgresql":
        return create_engine(parsed, pool_pre_ping=True)
    raise ValueError(f"unsupported database {masked_url(url)!r}: use sqlite:/// or postgresql://")


def _sqlite_engine(url: URL) -> Engine:
    if url.database and url.database != ":memory:" and not url.database.startswith("file:"):
        Path(url.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(
        url, connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_S}
    )
    event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def _sqlite_pragmas(dbapi_connection: Any, connection_record: Any) -> None:
    # WAL lets readers (API, alerts) run while the aggregator writes; SQLite leaves foreign
    # keys off unless asked on every connection.
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
    finally:
        cursor.close()


def session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions whose objects stay readable after commit (they are passed on, not re-queried)."""
    return sessionmaker(engine, expire_on_commit=False)


def alembic_config(url: str) -> Config:
    """An Alembic config for this repository's migrations against `url` (no ini file read)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # ConfigParser interpolates '%': escape it, or a URL-encoded password breaks the option.
    url_text = normalize_url(url).render_as_string(hide_password=False)
    config.set_main_option("sqlalchemy.url", url_text.replace("%", "%%"))
    return config


def upgrade(url: str) -> None:
    """Migrate the database at `url` to the newest revision (a no-op when already there).
    Safe across processes on PostgreSQL (an advisory lock in env.py), but Alembic keeps global
    state: never run two upgrades at once in one process."""
    log.info("migrating %s to head", masked_url(url))
    command.upgrade(alembic_config(url), "head")


def current_revision(url: str) -> str | None:
    """The revision the database is at; None before the first migration."""
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()
