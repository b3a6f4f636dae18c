"""Alembic environment: migrates the database of `sqlalchemy.url` when the caller set it (as
`services.storage.db.upgrade` does), else the one SparseGuard's settings name."""

from __future__ import annotations

from logging.config import fileConfig
from typing import Any, Literal

from alembic import context
from alembic.autogenerate.api import AutogenContext
from sqlalchemy import text

from services.config import Settings
from services.storage.db import make_engine, normalize_url
from services.storage.kb import include_name
from services.storage.models import Base, UTCDateTime

LOCK = 0x5347_4D49_4752  # "SGMIGR": the advisory lock that serialises PostgreSQL migrations
config = context.config
target_metadata = Base.metadata

# Only the `alembic` command line reads alembic.ini's logging sections; a programmatic upgrade
# runs without an ini file and keeps the application's logging as it is.
if config.config_file_name is not None:
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def database_url() -> str:
    return config.get_main_option("sqlalchemy.url") or Settings().database_url


def render_item(kind: str, obj: Any, autogen_context: AutogenContext) -> str | Literal[False]:
    """Autogenerate writes UTCDateTime as the plain column type it stores, so revisions never
    import application code."""
    if kind == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def run_migrations_offline() -> None:
    """Emit the SQL to stdout (`alembic upgrade head --sql`) instead of running it."""
    url = normalize_url(database_url())
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=url.get_backend_name() == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = make_engine(database_url())
    try:
        with engine.connect() as connection:
            context.configure(
                connection=connection,
                target_metadata=target_metadata,
                render_as_batch=connection.dialect.name == "sqlite",
                compare_type=True,
                render_item=render_item,
                include_name=include_name,  # full-text objects no model maps
            )
            with context.begin_transaction():
                if connection.dialect.name == "postgresql":
                    # Aggregators and workers each upgrade at start: one migrates, the others
                    # wait here and then find the database already at head.
                    connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": LOCK})
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
