"""The local services the integration tests talk to (PostgreSQL, Redis) and what a test does
when one is missing: on a developer's machine it is skipped, with the command that starts the
service; under CI (CI=true), where every service is meant to run, it fails instead, so a
broken set-up cannot pass as a green run of skipped tests."""

from __future__ import annotations

import os
from typing import NoReturn

import psycopg
import pytest
import redis
from psycopg.rows import TupleRow

PG_HOST = "127.0.0.1:5432"
PG_ADMIN = f"postgresql://postgres@{PG_HOST}/postgres"
REDIS_URL = os.environ.get("SPARSEGUARD_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def service_missing(service: str, where: str, start: str, error: object) -> NoReturn:
    """Skip the calling test because `service` is unreachable at `where`, or fail it when the
    environment says CI=true. `start` is the command that starts the service."""
    message = f"{service} is unreachable at {where} ({error}); start it with `{start}`"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{message}. CI=true: a missing service fails the run", pytrace=False)
    pytest.skip(message)


def postgres_admin() -> psycopg.Connection[TupleRow]:
    """An autocommit connection to the `postgres` database as user postgres, for creating and
    dropping each test's own database."""
    try:
        return psycopg.connect(PG_ADMIN, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as exc:
        error = exc  # reported outside the handler, without the chained traceback
    service_missing("PostgreSQL", PG_ADMIN, "service postgresql start", error)


def require_redis() -> str:
    """REDIS_URL, once a Redis server answers there."""
    with redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1) as client:
        try:
            client.ping()
            return REDIS_URL
        except redis.RedisError as exc:
            error = exc  # reported outside the handler, without the chained traceback
    service_missing("Redis", REDIS_URL, "service redis-server start", error)
