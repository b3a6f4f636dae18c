"""The storage layer against real databases: a SQLite file and a temporary PostgreSQL database
(skipped only when PostgreSQL is unreachable, and then failed under CI). Migrations build the
schema; the repository dedupes replays, filters, and round-trips snapshots, calibrations and
UTC timestamps."""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import func, inspect, select
from sqlalchemy.exc import IntegrityError, StatementError
from sqlalchemy.orm import Session, sessionmaker

from services.storage import kb, repository
from services.storage.db import (
    alembic_config,
    current_revision,
    make_engine,
    masked_url,
    normalize_url,
    session_factory,
    upgrade,
)
from services.storage.models import Base, RequestSummary, WindowSnapshot
from tests.service_fixtures import PG_HOST, postgres_admin

REPO_ROOT = Path(__file__).resolve().parents[1]
T0 = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The URL of a database with no tables yet."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'sparseguard.db'}"
        return
    name = f"sg_test_{secrets.token_hex(6)}"
    with postgres_admin() as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        try:
            # A bare postgresql:// URL: make_engine must pick the psycopg 3 driver itself.
            yield f"postgresql://postgres@{PG_HOST}/{name}"
        finally:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def url(empty_url: str) -> str:
    upgrade(empty_url)
    return empty_url


@pytest.fixture
def factory(url: str) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(url)
    yield session_factory(engine)
    engine.dispose()


def count_summaries(session: Session, **columns: str) -> int:
    """Stored request summaries, only those with these column values when given."""
    statement = select(func.count()).select_from(RequestSummary).filter_by(**columns)
    return session.scalar(statement) or 0


def summary(trace_id: str, **overrides: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "trace_id": trace_id,
        "time": T0,
        "model": "smollm",
        "level": "balanced",
        "mode": "serve",
        "api": "openai",
        "status": "ok",
        "calibration_version": "cal-1",
        "partition": 0,
        "offset": 2**40,
        "sparsity_ratio": 0.5,
        "ttft_ms": 12.5,
        "prompt_tokens": 10,
        "completion_tokens": 20,
        "event": {"trace_id": trace_id, "extra": [1, 2]},
    }
    return row | overrides


def calibration(version: str, target: float, **overrides: Any) -> dict[str, Any]:
    record: dict[str, Any] = {
        "version": version,
        "model_id": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "level": "balanced",
        "weights_sha256": "ab" * 32,
        "created_at": T0,
        "target_sparsity": target,
        "realised_sparsity": target - 0.01,
        "perplexity_change_pct": 1.5,
        "reason": "cli",
        "artefact": {"thresholds": [0.1, 0.2]},
    }
    return record | overrides


def test_migrations_create_every_table_and_rerun_is_a_noop(empty_url: str) -> None:
    assert current_revision(empty_url) is None
    upgrade(empty_url)
    head = ScriptDirectory.from_config(alembic_config(empty_url)).get_current_head()
    assert head is not None
    assert current_revision(empty_url) == head
    engine = make_engine(empty_url)
    try:
        # The knowledge base's full-text tables (FTS5 on SQLite) are not mapped by any model.
        tables = {
            name for name in inspect(engine).get_table_names() if kb.include_name(name, "table", {})
        }
        assert tables == {*Base.metadata.tables, "alembic_version"}
        with session_factory(engine).begin() as session:
            repository.insert_summaries(session, [summary("kept")])
        upgrade(empty_url)
        assert current_revision(empty_url) == head
        with session_factory(engine)() as session:
            assert count_summaries(session) == 1
        with engine.connect() as connection:  # the models describe exactly what was migrated
            context = MigrationContext.configure(connection, opts={"include_name": kb.include_name})
            assert compare_metadata(context, Base.metadata) == []
    finally:
        engine.dispose()


def test_schema_is_created_only_by_migrations() -> None:
    needle = "create" + "_all("  # split so this file does not match itself
    offenders = [
        str(path.relative_to(REPO_ROOT))
        for folder in ("services", "alerts", "dashboards", "sparse_engine", "migrations", "tests")
        for path in (REPO_ROOT / folder).rglob("*.py")
        if needle in path.read_text(encoding="utf-8")
    ]
    assert offenders == []


def test_insert_summaries_dedupes_within_and_across_batches(
    factory: sessionmaker[Session],
) -> None:
    batch = [summary(f"t{i:04d}") for i in range(995)]
    batch += [summary(f"t{i:04d}", model="replayed") for i in range(5)]  # 1000 rows
    with factory.begin() as session:
        assert repository.insert_summaries(session, batch) == {f"t{i:04d}" for i in range(995)}
    with factory.begin() as session:
        assert repository.insert_summaries(session, batch) == set()
        assert repository.insert_summaries(session, batch[:1]) == set()
        assert repository.insert_summaries(session, []) == set()
        overlap = [summary("t0994"), summary("new-1"), summary("new-2", level="aggressive")]
        assert repository.insert_summaries(session, overlap) == {"new-1", "new-2"}
    with factory() as session:
        assert count_summaries(session) == 997
        assert count_summaries(session, model="replayed") == 0
        assert count_summaries(session, model="smollm", level="aggressive") == 1
        assert count_summaries(session, level="balanced") == 996


def test_insert_summaries_rejects_trace_ids_the_column_cannot_hold(
    factory: sessionmaker[Session],
) -> None:
    with factory() as session, pytest.raises(ValueError, match="trace_id must be"):
        repository.insert_summaries(session, [summary("x" * 65)])


def test_summaries_since_filters_time_and_partitions_in_time_order(
    factory: sessionmaker[Session],
) -> None:
    rows = [
        summary(f"p{i}", time=T0 + timedelta(minutes=10 - i), partition=i % 3) for i in range(9)
    ]
    rows[0] |= {"sparsity_ratio": math.nan, "ttft_ms": math.inf}  # stored as missing
    with factory.begin() as session:
        repository.insert_summaries(session, rows)
    since = T0 + timedelta(minutes=3)  # p0..p7
    with factory() as session:
        everything = repository.summaries_since(session, since)
        picked = repository.summaries_since(session, since, partitions={0, 2})
        assert repository.summaries_since(session, since, partitions=set()) == []
    assert [s.trace_id for s in everything] == [f"p{i}" for i in range(7, -1, -1)]
    assert [s.trace_id for s in picked] == ["p6", "p5", "p3", "p2", "p0"]
    assert picked[0].offset == 2**40
    assert picked[0].event == {"trace_id": "p6", "extra": [1, 2]}
    assert (everything[-1].sparsity_ratio, everything[-1].ttft_ms) == (None, None)


def test_timestamps_come_back_timezone_aware_utc(factory: sessionmaker[Session]) -> None:
    local = datetime(2025, 6, 1, 14, 30, tzinfo=timezone(timedelta(hours=2)))
    with factory.begin() as session:
        repository.insert_summaries(session, [summary("tz", time=local)])
        repository.save_snapshots(
            session, [{"model": "m", "level": "l", "window": "5m", "window_end": local, "data": {}}]
        )
    with factory() as session:
        stored = session.scalars(select(RequestSummary)).one()
        snapshot = session.scalars(select(WindowSnapshot)).one()
    assert stored.time == local and stored.time.tzinfo is UTC
    assert stored.time.hour == 12
    assert snapshot.window_end.tzinfo is UTC and snapshot.taken_at.tzinfo is UTC
    with factory() as session, pytest.raises(StatementError, match="timezone-aware"):
        repository.insert_summaries(session, [summary("naive", time=datetime(2025, 6, 1))])


def test_calibrations_upsert_and_targets(factory: sessionmaker[Session]) -> None:
    with factory.begin() as session:
        repository.upsert_calibration(session, calibration("cal-1", 0.5))
        repository.upsert_calibration(session, calibration("cal-2", 0.7))
    with factory.begin() as session:
        repository.upsert_calibration(session, calibration("cal-1", 0.55, reason="alert"))
    with factory() as session:
        assert repository.calibration_targets(session) == {"cal-1": 0.55, "cal-2": 0.7}
        with pytest.raises(IntegrityError):
            repository.upsert_calibration(session, calibration("cal-3", 0.5, reason="whim"))


def test_urls_pick_psycopg_and_mask_passwords() -> None:
    assert normalize_url("postgresql://u:p@h/db").drivername == "postgresql+psycopg"
    assert normalize_url("postgresql+psycopg2://u@h/db").drivername == "postgresql+psycopg2"
    assert masked_url("postgresql://u:s%40cret@h:5432/db") == "postgresql+psycopg://u:***@h:5432/db"
    assert masked_url("sqlite:////tmp/x.db") == "sqlite:////tmp/x.db"
    with pytest.raises(ValueError, match="unsupported database"):
        make_engine("mysql://u@h/db")
