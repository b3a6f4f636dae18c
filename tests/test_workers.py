"""Celery jobs against real brokers and real worker processes: a recalibration from the admin
endpoint to a running gateway serving the new version, and a golden-set check on the real
model (Redis, a Kafka-compatible broker); a worker killed mid-task leaves no partial
calibration and the redelivered task completes; the embedded SQLite transport, with beat
re-sending a job whose message was lost, and a trust fit reaching a running gateway. The beat
lock: tests/test_beat_lock.py."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
import torch
from kafka import KafkaConsumer, TopicPartition
from prometheus_client import CollectorRegistry
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from services.aggregator.job_figures import job_samples
from services.aggregator.metrics import AggregatorMetrics
from services.config import Settings
from services.gateway.app import create_app
from services.gateway.trust import serving_versions
from services.shared.serving import serve
from services.storage.db import make_engine, session_factory, upgrade
from services.storage.models import CalibrationRecord, GoldenRun, JobRun
from services.telemetry.broker import Broker
from services.workers import jobs
from services.workers.app import make_celery
from services.workers.golden_set import GoldenItem, write_golden
from sparse_engine.calibration.store import CalibrationStore
from sparse_engine.data.corpora import mtbench_questions, mtbench_references
from sparse_engine.model.loader import LoadedModel, load_model
from sparse_engine.runtime.engine import Engine
from sparse_engine.sparsity.plan import Level
from sparse_engine.trust.qa import load_qa, qa_sample
from tests.gateway_fixtures import RecordingSink
from tests.polling import wait_until
from tests.test_trust_reload import qa_items, trust_messages, write_qa
from tests.tiny import tiny_model
from tests.worker_fixtures import SPARSEGUARD, Process, job_env


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


@dataclass
class Stack:
    env: dict[str, str]
    settings: Settings
    sessions: sessionmaker[Session]
    worker: Process


@pytest.fixture(scope="module")
def stack(
    home: Path,
    calibrated_store: CalibrationStore,
    redis_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    """A Kafka-compatible broker, Redis, and one real worker; state in a fresh directory that
    starts with the session's balanced calibration and a three-prompt golden set."""
    state = tmp_path_factory.mktemp("stack")
    for cal in calibrated_store.list():
        CalibrationStore(state / "calibrations").save(cal)
    questions = mtbench_questions(home)[:3]
    references = mtbench_references(home)
    golden_file = state / "golden.jsonl"
    write_golden(
        golden_file,
        [
            GoldenItem(str(q.question_id), q.turns[0], references.get(q.question_id, q.turns[0]))
            for q in questions
        ],
    )
    broker = Broker()
    broker.start()
    env = job_env(
        state,
        home,
        jobs__broker_url=redis_url,
        telemetry__bootstrap_servers=broker.bootstrap,
        jobs__golden_set=str(golden_file),
        jobs__golden_max_new_tokens=12,
        jobs__golden_levels='["balanced"]',
        engine__threads=2,  # the worker computes alone here; both cores take a minute off CI
    )
    worker = Process(["worker"], env, state / "worker.log")
    try:
        settings = settings_from(env)
        yield Stack(env, settings, sessions_for(settings), worker)
    finally:
        worker.stop()
        broker.stop()


@pytest.mark.slow
def test_a_recalibration_reaches_a_running_gateway_without_a_restart(
    stack: Stack, smollm: LoadedModel
) -> None:
    engine = Engine(
        smollm,
        CalibrationStore(stack.settings.calibrations_dir).latest_plans(smollm.weights_sha256),
    )
    old = engine.plan(Level.BALANCED).calibration_version
    app = create_app(stack.settings, engine=engine)
    with serve(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        wait_until(lambda: app.state.runtime.control.ready.is_set(), 30)
        queued = client.post("/admin/recalibrate", json={"level": "balanced"})
        assert queued.status_code == 202, queued.text
        job_id = queued.json()["job_id"]

        def finished() -> bool:
            return client.get(f"/admin/jobs/{job_id}").json()["status"] in ("succeeded", "failed")

        wait_until(finished, 300, 1.0)
        job = client.get(f"/admin/jobs/{job_id}").json()
        assert job["status"] == "succeeded", stack.worker.output()[-3000:]
        new = job["result"]["version"]
        assert new != old

        def serving() -> str:
            reply = client.post(
                "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "What is the capital of France?"}],
                    "max_tokens": 4,
                    "ir_sparse_level": "balanced",
                },
            )
            assert reply.status_code == 200, reply.text
            return reply.headers["X-IR-Calibration"]

        wait_until(lambda: serving() == new, 30, 0.5)
    assert engine.plan(Level.BALANCED).calibration_version == new
    with stack.sessions() as session:
        record = session.get(CalibrationRecord, new)
    assert record is not None and record.reason == "operator"
    assert (
        published_versions(
            stack.settings.telemetry.bootstrap_servers, stack.settings.telemetry.control_topic
        )[-1]
        == new
    )


@pytest.mark.slow
def test_a_golden_check_on_a_worker_stores_runs_and_exposes_metrics(stack: Stack) -> None:
    done = subprocess.run(
        [str(SPARSEGUARD), "jobs", "golden-check", "--now", "--wait", "--timeout", "300"],
        env=stack.env,
        capture_output=True,
        text=True,
        timeout=330,
    )
    assert done.returncode == 0, done.stderr[-3000:] + stack.worker.output()[-3000:]
    job = json.loads(done.stdout[done.stdout.index("{") :])
    assert job["status"] == "succeeded" and job["reason"] == "operator"
    figures = job["result"]["levels"]["balanced"]
    with stack.sessions() as session:
        (run,) = session.scalars(select(GoldenRun)).all()
        registry = CollectorRegistry()
        samples = job_samples(session, datetime.now(UTC), AggregatorMetrics(registry))
    assert run.prompts == 3 and run.level == "balanced"
    assert 0.0 <= run.score_dense <= 100.0 and 0.0 <= run.score_sparse <= 100.0
    assert run.drift == pytest.approx(run.score_dense - run.score_sparse)
    assert run.drift_low is not None and run.drift_low <= run.drift
    assert run.kl_mean >= 0.0 and 0 <= run.answers_changed <= 3
    assert figures["drift"] == pytest.approx(run.drift, abs=1e-3)
    assert figures["status"] == run.status
    labels = {"model": run.model_id, "level": "balanced"}
    assert registry.get_sample_value("sparseguard_golden_drift_points", labels) == run.drift
    assert registry.get_sample_value("sparseguard_golden_drift_low_points", labels) == (
        run.drift_low
    )
    assert samples[0].values["golden_check_age_s"] is not None
    assert samples[0].values["golden_check_age_s"] < 600


@pytest.mark.slow
def test_worker_killed_mid_recalibration_leaves_no_version_and_the_retry_completes(
    kafka_broker: Broker, home: Path, redis_url: str, tmp_path: Path
) -> None:
    env = job_env(
        tmp_path / "state",
        home,
        jobs__broker_url=redis_url,
        jobs__visibility_timeout_s=8,
        telemetry__bootstrap_servers=kafka_broker.bootstrap,
        engine__threads=2,  # one worker at a time computes here
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
    beats = [Process(["beat"], env, tmp_path / f"beat-{i}.log") for i in (1, 2)]
    try:
        wait_until(lambda: status(sessions, lost_id) == "failed", 120, 0.5)
        wait_until(lambda: any("standing by" in b.output() for b in beats), 30, 0.2)
        assert all(b.alive() for b in beats)
        holders = [b for b in beats if "beat lock acquired" in b.output()]
    finally:
        for process in (*beats, worker):
            process.stop()
    job = job_row(sessions, lost_id)
    assert job.result == {"error": "the dense level needs no calibration; choose a sparse level"}
    assert len(holders) == 1, "exactly one beat schedules; the other stands by"


def test_a_trust_fit_job_on_a_worker_reaches_a_running_gateway_without_a_restart(
    kafka_broker: Broker, tmp_path: Path
) -> None:
    # A tiny model as a model directory, which the worker loads like the served model; the
    # gateway serves the same weights and scores by the rule until the fit arrives.
    model_dir = tmp_path / "models" / "tiny-llama"
    tiny = tiny_model("llama")
    tiny.model.save_pretrained(model_dir)
    tiny.tokenizer.save_pretrained(model_dir)
    env = job_env(
        tmp_path / "state",
        tmp_path / "cache",
        engine__model=str(model_dir),
        engine__fast_path="off",
        telemetry__bootstrap_servers=kafka_broker.bootstrap,
        telemetry__partitions=1,
    )
    settings = settings_from(env)
    engine = Engine(load_model(model_dir), {})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the worker's thread count: the same greedy answers
    try:
        qa = write_qa(tmp_path / "qa.jsonl", qa_items(engine, 20, 3))
    finally:
        torch.set_num_threads(threads)
    sessions = sessions_for(settings)
    params = {"data": str(qa), "n": 10, "level": "dense", "max_new_tokens": 3, "if_missing": True}
    app = create_app(settings, engine=engine, sink=RecordingSink())
    with serve(app):
        runtime = app.state.runtime
        assert runtime.control.ready.wait(30) and runtime.trust.model is None
        job_id = jobs.submit(sessions, make_celery(settings), "trust_fit", "first-serve", params)
        worker = Process(["worker"], env, tmp_path / "worker.log")
        try:
            wait_until(lambda: status(sessions, job_id) in jobs.FINISHED, 180, 0.5)
            job = job_row(sessions, job_id)
            assert job.status == "succeeded", worker.output()[-3000:]
            assert job.result is not None
            (fitted,) = job.result["models"].values()
            version = fitted["version"]
            wait_until(lambda: serving_versions(runtime.trust)["default"] == version, 30, 0.2)
        finally:
            worker.stop()
    # The fit half of the file: the items whose passage hashes to it (the greedy answers, and
    # so the passages, vary with the machine's arithmetic).
    fit_items = len(qa_sample(load_qa(str(qa), tmp_path / "cache"), "fit", 10))
    assert fitted["items"] == fit_items and 0 < fitted["right"] < fit_items
    (message,) = trust_messages(kafka_broker.bootstrap, settings.telemetry.control_topic)
    assert (message.model.version, message.reason) == (version, "first-serve")
    assert message.model.fit_data["job_id"] == job_id
