"""Job plumbing without a worker: the job table's life cycle, scheduling, messages on the
embedded Celery transport (read back with kombu), control messages, alert actions, golden
figures and the drift actions. Worker processes are in test_workers.py."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.schedules import crontab
from prometheus_client import CollectorRegistry
from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from alerts.evaluator import Sample
from services.aggregator.alert_loop import AlertLoop
from services.aggregator.job_figures import job_samples
from services.aggregator.metrics import AggregatorMetrics
from services.config import (
    AlertSettings,
    EngineSettings,
    JobSettings,
    Settings,
    SignalSettings,
    TelemetrySettings,
)
from services.storage.db import make_engine, session_factory, upgrade
from services.storage.models import (
    AlertRecord,
    CalibrationRecord,
    GoldenRun,
    JobRun,
    RequestSummary,
)
from services.storage.repository import flags
from services.telemetry import control
from services.workers import jobs
from services.workers.app import beat_schedule, cron, make_celery
from services.workers.drift import record
from services.workers.golden import store_runs
from services.workers.golden_score import LevelDrift
from services.workers.jobs import ClaimedJob
from services.workers.recalibration import _data, calibration_reason, pack, recent_prompts
from services.workers.tasks import Context, schedule_once
from sparse_engine.calibration.pipeline import CalibrationConfig
from tests.tiny import calibration_of, tiny_engine

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(home=tmp_path, telemetry=TelemetrySettings(enabled=False))


@pytest.fixture
def sessions(settings: Settings) -> sessionmaker[Session]:
    upgrade(settings.database_url)
    return session_factory(make_engine(settings.database_url))


@pytest.fixture
def celery(settings: Settings) -> Iterator[Celery]:
    app = make_celery(settings)  # the embedded SQLite transport: a real broker, no server
    yield app
    app.close()


def sent(app: Celery, queue: str) -> list[tuple[str, list[Any]]]:
    """(task name, args) of every message waiting in `queue`, taken off it."""
    found = []
    with app.connection_for_read() as connection:
        waiting = connection.SimpleQueue(queue)
        while True:
            try:
                message = waiting.get(timeout=0.5)
            except waiting.Empty:
                break
            args, _kwargs, _embed = message.decode()
            found.append((message.headers["task"], args))
            message.ack()
        waiting.close()
    return found


def test_a_job_is_claimed_until_it_finishes_and_then_skipped(
    sessions: sessionmaker[Session],
) -> None:
    with sessions.begin() as session:
        job_id = jobs.create_job(session, "recalibrate", "operator", {"level": "balanced"}).id
    first = jobs.claim(sessions, job_id)
    assert first is not None and (first.kind, first.attempts) == ("recalibrate", 1)
    # The worker died: the redelivered task claims the running job again.
    again = jobs.claim(sessions, job_id)
    assert again is not None and again.attempts == 2
    jobs.finish(sessions, job_id, {"version": "v2"})
    assert jobs.claim(sessions, job_id) is None
    with sessions() as session:
        job = session.get(JobRun, job_id)
        assert job is not None
        assert (job.status, job.result, job.attempts) == ("succeeded", {"version": "v2"}, 2)
        assert job.finished_at is not None and job.started_at is not None
    with pytest.raises(jobs.JobNotFoundError):
        jobs.claim(sessions, job_id + 1)
    with sessions.begin() as session, pytest.raises(ValueError, match="unknown job kind"):
        jobs.create_job(session, "reboot", "operator", {})


def test_a_retry_requeues_and_a_failure_keeps_the_error(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        job_id = jobs.create_job(session, "golden_check", "operator", {}).id
    jobs.claim(sessions, job_id)
    jobs.requeue(sessions, job_id, "KafkaTimeoutError: broker down")
    with sessions() as session:
        job = session.get(JobRun, job_id)
        assert job is not None and job.status == "queued"
        assert job.result == {"last_error": "KafkaTimeoutError: broker down"}
    jobs.fail(sessions, job_id, "no sparse level is calibrated")
    assert jobs.claim(sessions, job_id) is None


def test_submit_stores_the_job_and_sends_its_task(
    sessions: sessionmaker[Session], celery: Celery, settings: Settings
) -> None:
    job_id = jobs.submit(sessions, celery, "recalibrate", "operator", {"level": "aggressive"})
    assert sent(celery, settings.jobs.queue) == [("sparseguard.recalibrate", [job_id])]


def test_redispatch_sends_only_stale_unstarted_jobs(
    sessions: sessionmaker[Session], celery: Celery, settings: Settings
) -> None:
    old = datetime.now(UTC) - timedelta(hours=1)
    with sessions.begin() as session:
        lost = jobs.create_job(session, "recalibrate", "alert:X", {"level": "balanced"})
        lost.created_at = old
        running = jobs.create_job(session, "golden_check", "schedule", {})
        running.created_at, running.started_at = old, old
        fresh = jobs.create_job(session, "golden_check", "operator", {})
        ids = (lost.id, running.id, fresh.id)
    assert jobs.redispatch_stale(sessions, celery, older_than_s=300) == [ids[0]]
    assert sent(celery, settings.jobs.queue) == [("sparseguard.recalibrate", [ids[0]])]


def test_a_scheduled_job_is_made_once_per_utc_day(
    sessions: sessionmaker[Session], celery: Celery, settings: Settings
) -> None:
    ctx = Context(celery, settings)
    first = schedule_once(ctx, "golden_check", {})
    assert first is not None
    assert schedule_once(ctx, "golden_check", {}) is None  # a beat tick delivered twice
    with sessions() as session:
        job = session.get(JobRun, first)
        assert job is not None and job.reason == "schedule"
        assert job.params == {"slot": datetime.now(UTC).date().isoformat()}
    assert sent(celery, settings.jobs.queue) == [("sparseguard.golden_check", [first])]


def test_schedules_are_cron_in_utc_and_bad_expressions_say_how_to_fix_them() -> None:
    nightly = cron("0 3 * * *")
    assert nightly == crontab(minute="0", hour="3")
    schedule = beat_schedule(JobSettings())
    assert schedule["golden-check-nightly"]["schedule"] == nightly
    assert "recalibrate-scheduled" not in schedule
    weekly = beat_schedule(JobSettings(recalibrate_cron="30 2 * * 0"))
    assert weekly["recalibrate-scheduled"]["schedule"] == crontab("30", "2", day_of_week="0")
    with pytest.raises(ValueError, match="needs 5 fields"):
        cron("0 3 * *")
    with pytest.raises(ValueError, match="'0 25 \\* \\* \\*'"):
        cron("0 25 * * *")


def test_control_messages_round_trip_and_reject_garbage() -> None:
    engine = tiny_engine()
    cal = calibration_of(engine, "tiny-balanced-v2")
    key, value, headers = control.encode(cal, "alert:SparsityBelowTarget")
    assert key == f"{cal.weights_sha256}|balanced".encode()
    assert dict(headers)["ce_type"] == control.CALIBRATION_PUBLISHED.encode()
    message = control.decode(value)
    assert isinstance(message, control.CalibrationPublished)
    assert message.calibration.to_dict() == cal.to_dict()
    assert message.reason == "alert:SparsityBelowTarget"
    assert control.decode(b'{"type": "something.else"}') is None
    for bad in (b"not json", b"[1]", b'{"type": "%s"}' % control.CALIBRATION_PUBLISHED.encode()):
        with pytest.raises(ValueError):
            control.decode(bad)


def test_alert_actions_queue_and_send_a_recalibration_and_raise_the_finetune_flag(
    sessions: sessionmaker[Session], celery: Celery, settings: Settings, tmp_path: Path
) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(
        "rules:\n"
        "  - name: DriftHigh\n    metric: drift_kl_mean\n    window: 5m\n    op: '>'\n"
        "    threshold: 1.2\n    severity: critical\n"
        "    actions: [recalibrate, flag_finetune]\n"
    )
    loop = AlertLoop(AlertSettings(rules_file=rules), sessions, CollectorRegistry(), celery=celery)
    sample = Sample(
        labels={"model": "m1", "level": "aggressive", "window": "5m"},
        values={"drift_kl_mean": 2.0, "requests": 100.0},
    )
    traces = {("m1", "aggressive"): ["a" * 32, "b" * 32], ("m1", "balanced"): ["c" * 32]}
    transitions = loop.tick({}, [sample], NOW, exemplars=traces)
    assert [t.state for t in transitions] == ["firing"]
    with sessions() as session:
        (job,) = session.scalars(select(JobRun)).all()
        (flag,) = flags(session)
        (alert,) = session.scalars(select(AlertRecord)).all()
    # The alert names its key's latest requests, newest first; the job runs in the newest's trace.
    assert alert.annotations["trace_ids"] == f"{'b' * 32},{'a' * 32}"
    assert job.trace_id == "b" * 32
    assert (job.kind, job.reason, job.params["level"]) == (
        "recalibrate",
        "alert:DriftHigh",
        "aggressive",
    )
    assert (flag.model_id, flag.flag, flag.reason) == ("m1", "finetune", "alert:DriftHigh")
    assert sent(celery, settings.jobs.queue) == [("sparseguard.recalibrate", [job.id])]


def drift(level: str, value: float, low: float | None = None, high: float = 99.0) -> LevelDrift:
    """A level's drift of `value` points, its interval [low (default: value), high]."""
    low = value if low is None else low
    return LevelDrift(
        level, f"{level}-v1", "chrf", 20.0, 20.0 - value, value, low, high, 0.1, 3, 10
    )


def test_a_24h_drift_mean_over_the_limit_queues_recalibration_and_flags_the_model(
    sessions: sessionmaker[Session], settings: Settings
) -> None:
    signals = SignalSettings(drift_budget=0.8, drift_recalibrate=1.2)
    settings = settings.model_copy(update={"signals": signals})
    job = ClaimedJob(1, "golden_check", "schedule", {}, 1)
    with sessions.begin() as session:
        first = record(
            session, settings, "m1", [drift("balanced", 2.0)], job, NOW - timedelta(hours=2)
        )
        assert "recalibration_job" in first["balanced"]  # 2.0 alone is over 1.2
    with sessions.begin() as session:
        # 0.3 and 0.6 today plus an old 5.0 outside the 24 h window
        session.query(GoldenRun).delete()
        store_runs(session, "m2", [drift("balanced", 5.0)], NOW - timedelta(hours=30), 0.8)
        record(session, settings, "m2", [drift("balanced", 0.3)], job, NOW - timedelta(hours=1))
        quiet = record(session, settings, "m2", [drift("balanced", 0.6)], job, NOW)
    with sessions.begin() as session:
        again = record(session, settings, "m1", [drift("balanced", 3.0)], job, NOW)
    assert again["balanced"]["recalibration_job_earlier"] == first["balanced"]["recalibration_job"]
    assert "recalibration_job" not in again["balanced"]  # one drift recalibration a day
    assert quiet["balanced"]["drift_low_24h"] == pytest.approx(0.45)
    assert "recalibration_job" not in quiet["balanced"]
    assert quiet["balanced"]["over_budget"] is False
    with sessions.begin() as session:  # a point over the limit whose interval reaches below it
        noisy = record(session, settings, "m3", [drift("balanced", 2.0, low=0.5)], job, NOW)
    assert "recalibration_job" not in noisy["balanced"]
    assert noisy["balanced"]["status"] == "inconclusive"
    with sessions() as session:
        recalibrations = session.scalars(select(JobRun).where(JobRun.kind == "recalibrate")).all()
        raised = [(f.model_id, f.flag) for f in flags(session)]
    assert [(j.reason, j.params["level"]) for j in recalibrations] == [
        ("golden-drift:balanced", "balanced")
    ]
    assert raised == [("m1", "finetune")]


def test_job_figures_become_samples_and_gauges(sessions: sessionmaker[Session]) -> None:
    registry = CollectorRegistry()
    metrics = AggregatorMetrics(registry)
    with sessions() as session:
        [age] = job_samples(session, NOW, metrics)
    assert age.values == {"golden_check_age_s": None}  # nothing to measure from yet
    with sessions.begin() as session:
        session.add(
            CalibrationRecord(
                version="v1",
                model_id="m1",
                level="balanced",
                weights_sha256="0" * 64,
                created_at=NOW - timedelta(hours=30),
                target_sparsity=0.45,
                artefact={},
            )
        )
    with sessions() as session:
        [age] = job_samples(session, NOW, metrics)
    assert age.values["golden_check_age_s"] == 30 * 3600  # no check since the first calibration
    job = ClaimedJob(1, "golden_check", "schedule", {}, 1)
    limits = SignalSettings(drift_budget=0.8, drift_recalibrate=1.2)  # lower bounds' mean 1.25
    settings = Settings(home=Path("/nonexistent"), signals=limits)
    with sessions.begin() as session:
        record(session, settings, "m1", [drift("aggressive", 1.0)], job, NOW - timedelta(hours=3))
        latest = drift("aggressive", 2.0, low=1.5, high=2.5)
        record(session, settings, "m1", [latest], job, NOW - timedelta(hours=1))
    with sessions() as session:
        samples = job_samples(session, NOW, metrics)
    assert samples[0].values["golden_check_age_s"] == 3600
    assert samples[1].labels == samples[2].labels == {"model": "m1", "level": "aggressive"}
    assert samples[1].values == {"golden_drift": 2.0}
    assert samples[2].values == {"golden_drift_low": 1.5}
    gauge = registry.get_sample_value
    labels = {"model": "m1", "level": "aggressive"}
    assert gauge("sparseguard_golden_drift_points", labels) == 2.0
    assert gauge("sparseguard_golden_drift_low_points", labels) == 1.5
    assert gauge("sparseguard_golden_drift_high_points", labels) == 2.5
    assert gauge("sparseguard_golden_drift_low_24h_points", labels) == 1.25
    status = latest.status(settings.signals.drift_budget)
    for name in ("ok", "inconclusive", "over-budget"):
        expected = 1.0 if name == status else 0.0
        assert gauge("sparseguard_golden_drift_status", {**labels, "status": name}) == expected
    assert gauge("sparseguard_golden_check_age_seconds") == 3600
    assert gauge("sparseguard_model_flag", {"model": "m1", "flag": "finetune"}) == 1.0
    assert gauge("sparseguard_job_runs", {"kind": "recalibrate", "status": "queued"}) == 1.0
    assert gauge("sparseguard_job_runs", {"kind": "golden_check", "status": "failed"}) == 0.0


def test_recalibration_uses_kept_traffic_only_when_configured(
    sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    engine = tiny_engine()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"Corpus document {i}. " * 20 for i in range(40)))
    prompts = [
        f"Question {i}: what is the weather like in city number {i}? " * 4 for i in range(200)
    ]
    with sessions.begin() as session:
        for i, prompt in enumerate(prompts):
            event = {"prompt_text": prompt} if i % 2 == 0 else {}
            session.add(_summary(f"t{i}", engine.lm.model_id, event))
    cfg = CalibrationConfig(samples=4, seq_len=64, heldout_tokens=128)
    plain = Settings(home=tmp_path, engine=EngineSettings(calibration_corpus=str(corpus)))
    kept = plain.model_copy(
        update={
            "telemetry": TelemetrySettings(keep_prompt_text=True),
            "jobs": JobSettings(traffic_min_prompts=50),
        }
    )
    assert _data(kept, sessions, engine.lm, cfg).name == "traffic"
    assert _data(plain, sessions, engine.lm, cfg).name == str(corpus)
    too_few = kept.model_copy(update={"jobs": JobSettings(traffic_min_prompts=500)})
    assert _data(too_few, sessions, engine.lm, cfg).name == str(corpus)
    assert _data(plain, sessions, engine.lm, cfg).sources == ()
    other = tmp_path / "other.txt"
    other.write_text("\n\n".join(f"Another text {i}, about rivers. " * 20 for i in range(40)))
    mixed = EngineSettings(calibration_corpus=f"{corpus}+{other}")  # per source by default
    data = _data(Settings(home=tmp_path, engine=mixed), sessions, engine.lm, cfg)
    assert data.source_names == (str(corpus), str(other)) and set(data.sources) == {0, 1}
    with pytest.raises(ValidationError, match="has one part"):
        EngineSettings(calibration_corpus="wiki", calibration_per_source=True)
    with sessions() as session:
        found = recent_prompts(session, engine.lm.model_id, NOW - timedelta(days=1))
    assert len(found) == 100 and (found[0], found[-1]) == (prompts[0], prompts[198])


def _summary(trace_id: str, model: str, event: dict[str, Any]) -> RequestSummary:
    return RequestSummary(
        trace_id=trace_id,
        time=datetime.now(UTC) - timedelta(seconds=int(trace_id[1:])),
        model=model,
        level="balanced",
        mode="serve",
        api="openai",
        status="ok",
        event=event,
    )


def test_prompts_are_packed_into_documents_and_reasons_map_to_categories() -> None:
    docs = pack(["a" * 600, "b" * 600, "c" * 600, "d" * 10], size=1000)
    assert docs == ["a" * 600 + "\n\n" + "b" * 600, "c" * 600 + "\n\n" + "d" * 10]
    assert [calibration_reason(r) for r in ("alert:X", "golden-drift:balanced", "schedule")] == [
        "alert",
        "alert",
        "schedule",
    ]
    assert calibration_reason("operator") == "operator"
