"""Celery jobs against real brokers and real worker processes: a worker killed mid-task leaves
no partial calibration and the redelivered task completes (Redis); the embedded SQLite
transport, with beat re-sending a job whose message was lost; the beat lock."""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from kafka import KafkaConsumer, TopicPartition
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from services.broker import Broker
from services.config import Settings
from services.storage.db import make_engine, session_factory, upgrade
from services.storage.models import CalibrationRecord, JobRun
from services.workers import jobs
from services.workers.app import make_celery
from services.workers.beat import FileLock, RedisLock, wait_for_lock
from sparse_engine.artefacts import CalibrationStore
from tests.polling import wait_until
from tests.worker_fixtures import REDIS_URL, Process, job_env, needs_redis


def settings_from(env: dict[str, str]) -> Settings:
    """The Settings a process started with `env` reads."""
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        return Settings()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def sessions_for(settings: Settings) -> sessionmaker[Session]:
    upgrade(settings.database_url)
    return session_factory(make_engine(settings.database_url))


def job_row(sessions: sessionmaker[Session], job_id: int) -> JobRun:
    with sessions() as session:
        job = session.get(JobRun, job_id)
        assert job is not None
        session.expunge(job)
        return job


def status(sessions: sessionmaker[Session], job_id: int) -> str:
    return job_row(sessions, job_id).status


@needs_redis
@pytest.mark.slow
def test_worker_killed_mid_recalibration_leaves_no_version_and_the_retry_completes(
    kafka_broker: Broker, home: Path, tmp_path: Path
) -> None:
    env = job_env(
        tmp_path / "state",
        home,
        jobs__broker_url=REDIS_URL,
        jobs__visibility_timeout_s=8,
        telemetry__bootstrap_servers=kafka_broker.bootstrap,
    )
    settings = settings_from(env)
    sessions = sessions_for(settings)
    store = CalibrationStore(settings.calibrations_dir)
    job_id = jobs.submit(
        sessions, make_celery(settings), "recalibrate", "operator", {"level": "conservative"}
    )

    first = Process(["worker"], env, tmp_path / "worker-1.log")
    try:
        wait_until(lambda: status(sessions, job_id) == "running", 90, 0.2)
        time.sleep(1.0)  # loading the model and collecting statistics take longer than this
    finally:
        first.kill()
    assert job_row(sessions, job_id).attempts == 1
    assert store.list() == [], "a killed recalibration must leave no version"
    assert not any(settings.calibrations_dir.glob("*")), "nor a temporary file"
    with sessions() as session:
        assert session.scalars(select(CalibrationRecord)).all() == []

    second = Process(["worker"], env, tmp_path / "worker-2.log")
    try:
        wait_until(lambda: status(sessions, job_id) != "running", 240, 0.5)
        job = job_row(sessions, job_id)
        assert job.status == "succeeded", second.output()[-3000:]
        time.sleep(3)  # the message restored while the retry ran is delivered again: a no-op
    finally:
        second.stop()
    assert job.attempts == 2
    made = [cal for cal in store.list() if cal.data.get("job_id") == job_id]
    assert job.result is not None
    assert [cal.version for cal in made] == [job.result["version"]]
    assert len(store.list()) == 1
    assert list(settings.calibrations_dir.glob("*.tmp")) == []
    with sessions() as session:
        (record,) = session.scalars(select(CalibrationRecord)).all()
    assert (record.version, record.reason, record.level) == (
        made[0].version,
        "operator",
        "conservative",
    )
    assert published_versions(kafka_broker.bootstrap, settings.telemetry.control_topic) == [
        made[0].version
    ]


def published_versions(bootstrap: str, topic: str) -> list[str]:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, consumer_timeout_ms=3000)
    try:
        consumer.assign([TopicPartition(topic, 0)])
        consumer.seek_to_beginning()
        return [json.loads(r.value)["calibration"]["version"] for r in consumer]
    finally:
        consumer.close()


def test_embedded_transport_beat_resends_a_lost_job_and_a_worker_runs_it(
    tmp_path: Path, home: Path
) -> None:
    # No broker server: kombu's SQLAlchemy transport on SQLite under the state directory.
    env = job_env(
        tmp_path / "state", home, jobs__redispatch_interval_s=1, jobs__redispatch_after_s=1
    )
    settings = settings_from(env)
    assert settings.celery_broker_url.startswith("sqla+sqlite:///")
    sessions = sessions_for(settings)
    with sessions.begin() as session:
        # A job whose task message never reached the broker (stored, never sent); dense has
        # no calibration, so the worker fails it at once with a useful message.
        lost = jobs.create_job(session, "recalibrate", "operator", {"level": "dense"})
        lost.created_at = datetime.now(UTC) - timedelta(minutes=5)
        lost_id = lost.id
    worker = Process(["worker"], env, tmp_path / "worker.log")
    beat = Process(["beat"], env, tmp_path / "beat.log")
    standby = Process(["beat"], env, tmp_path / "standby.log")
    try:
        wait_until(lambda: status(sessions, lost_id) == "failed", 120, 0.5)
        wait_until(lambda: "standing by" in standby.output(), 30, 0.2)
        assert standby.alive() and beat.alive()
    finally:
        for process in (standby, beat, worker):
            process.stop()
    job = job_row(sessions, lost_id)
    assert job.result == {"error": "the dense level needs no calibration; choose a sparse level"}
    assert "beat lock acquired" in beat.output()
    assert "beat lock acquired" not in standby.output()


def test_file_lock_admits_one_holder_at_a_time(tmp_path: Path) -> None:
    first, second = FileLock(tmp_path / "beat.lock"), FileLock(tmp_path / "beat.lock")
    assert first.acquire()
    assert not second.acquire()
    first.release()
    assert second.acquire()
    assert second.renew()
    second.release()


@needs_redis
def test_redis_lock_admits_one_holder_and_a_standby_takes_over(tmp_path: Path) -> None:
    key = f"sparseguard:test:{tmp_path.name}:beat-lock"
    holder, standby = RedisLock(REDIS_URL, 30, key), RedisLock(REDIS_URL, 30, key)
    assert holder.acquire()
    assert not standby.acquire()
    assert holder.renew() and not standby.renew()
    took_over = threading.Event()
    stop = threading.Event()

    def take_over() -> None:
        if wait_for_lock(standby, 0.05, stop):
            took_over.set()

    waiter = threading.Thread(target=take_over, daemon=True)
    waiter.start()
    time.sleep(0.3)
    assert not took_over.is_set()
    holder.release()
    assert took_over.wait(5)
    assert not holder.renew(), "the old holder must notice it lost the lock"
    assert standby.holder() == standby.token
    standby.release()
    stop.set()


@needs_redis
def test_redis_lock_expires_when_its_holder_stops_renewing(tmp_path: Path) -> None:
    key = f"sparseguard:test:{tmp_path.name}:beat-lock"
    crashed, standby = RedisLock(REDIS_URL, 0.3, key), RedisLock(REDIS_URL, 0.3, key)
    assert crashed.acquire()
    assert not standby.acquire()
    wait_until(standby.acquire, 5, 0.05)
    standby.release()
