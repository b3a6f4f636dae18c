"""New calibration versions without a restart: `Engine.install`, requests pinned to the plan
they were admitted with, the prefix cache across versions, the gateway's control listener on a
real broker, and the admin endpoints that queue a recalibration on the embedded Celery broker."""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from kafka import KafkaProducer
from prometheus_client import CollectorRegistry

from services.config import Settings, TelemetrySettings
from services.gateway.app import create_app
from services.gateway.auth import hash_key
from services.shared.serving import serve
from services.storage.db import make_engine, session_factory
from services.storage.models import JobRun
from services.telemetry.broker import Broker
from services.telemetry.control import CALIBRATION_PUBLISHED, publish_calibration
from services.workers.app import make_celery
from sparse_engine.calibration.store import CalibrationNotFoundError, CalibrationStore
from sparse_engine.runtime.engine import Engine, GenerationRequest
from sparse_engine.runtime.prefix_cache import CacheKey, SparseCacheMismatchError
from sparse_engine.sparsity.plan import Level, SparsityPlan
from tests.baseline_fixtures import healthy_level
from tests.gateway_fixtures import GatedEngine, RecordingSink, running_gateway, settings_for
from tests.polling import wait_until
from tests.tiny import calibration_of, tiny_engine

SYSTEM = "You are a careful assistant. Answer briefly and cite nothing. " * 2
CHAT = {
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 2,
    "ir_sparse_level": "balanced",
}


def balanced_v2(engine: Engine) -> SparsityPlan:
    """A new balanced version that computes differently: the aggressive thresholds."""
    aggressive = engine.plan(Level.AGGRESSIVE)
    return replace(aggressive, level=Level.BALANCED, calibration_version="tiny-balanced-v2")


def ask(question: str, level: Level | SparsityPlan, engine: Engine) -> tuple[str | None, int]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    request = GenerationRequest(messages=messages, max_new_tokens=3, ignore_eos=True)
    stats = engine.generate(request, level).result()
    return stats.calibration_version, stats.cached_tokens


# -- engine --------------------------------------------------------------------------------


def test_install_switches_new_generations_and_started_ones_finish_on_the_old_plan() -> None:
    engine = tiny_engine(cache=False)
    request = GenerationRequest(prompt="Sparse activations", max_new_tokens=12, ignore_eos=True)
    started = engine.generate(request, Level.BALANCED)
    first_delta = next(iter(started))
    plans_before = engine.plans
    engine.install(balanced_v2(engine))
    old = started.result()
    new = engine.generate(request, Level.BALANCED).result()
    assert first_delta and old.calibration_version == "tiny-balanced"
    assert new.calibration_version == "tiny-balanced-v2"
    assert old.signals is not None and new.signals is not None
    assert new.signals.sparsity_ratio > old.signals.sparsity_ratio + 0.1
    assert plans_before[Level.BALANCED].calibration_version == "tiny-balanced"  # not mutated
    assert engine.plans[Level.CONSERVATIVE].calibration_version == "tiny-conservative"


def test_install_gives_dense_a_silence_reference_and_refuses_misfits() -> None:
    engine = tiny_engine(cache=False)
    assert engine.plan(Level.DENSE).silence_thresholds is None
    plan = replace(balanced_v2(engine), silence_thresholds=(0.1, 0.2))
    engine.install(plan)
    dense = engine.plan(Level.DENSE)
    assert dense.is_dense and dense.silence_thresholds == (0.1, 0.2)
    engine.install(replace(plan, silence_thresholds=(0.3, 0.4), calibration_version="v3"))
    assert engine.plan(Level.DENSE).silence_thresholds == (0.1, 0.2)  # kept
    with pytest.raises(ValueError, match="dense"):
        engine.install(SparsityPlan(Level.DENSE))
    with pytest.raises(ValueError, match="has 2"):
        engine.install(replace(plan, thresholds={"down": (0.1, 0.2, 0.3)}))
    assert engine.plan(Level.BALANCED).calibration_version == "v3"


def test_prefix_cached_under_the_old_version_is_never_reused_under_the_new() -> None:
    engine = tiny_engine()
    old_plan = engine.plan(Level.BALANCED)
    ask("first?", Level.BALANCED, engine)
    assert ask("second?", Level.BALANCED, engine)[1] > 0  # the prefix is reused within v1
    engine.install(balanced_v2(engine))
    cache = engine.prefix_cache
    assert cache is not None
    prompt = engine.encode_messages([{"role": "system", "content": SYSTEM}])
    new_key = CacheKey(engine.lm.model_id, "tiny-balanced-v2", "balanced")
    with pytest.raises(SparseCacheMismatchError, match="tiny-balanced-v2"):
        cache.lookup(new_key, prompt + prompt[:1])
    mismatches = cache.mismatches
    assert ask("third?", Level.BALANCED, engine) == ("tiny-balanced-v2", 0)
    assert cache.mismatches == mismatches + 1
    assert ask("third, again?", Level.BALANCED, engine)[1] > 0  # v2 reuses its own prefix
    assert ask("second, again?", old_plan, engine)[1] > 0  # a request pinned to v1 still reuses v1


# -- gateway pipeline ----------------------------------------------------------------------


def test_request_in_flight_finishes_on_the_version_it_was_admitted_with(tmp_path: Path) -> None:
    gated = GatedEngine(tiny_engine())
    sink = RecordingSink()
    with (
        running_gateway(settings_for(tmp_path), gated, sink) as url,
        ThreadPoolExecutor(1) as pool,
    ):
        held = pool.submit(httpx.post, f"{url}/v1/chat/completions", json=CHAT, timeout=30)
        wait_until(lambda: gated.entered == 1)
        gated.install(balanced_v2(gated))
        gated.gate.set()
        old = held.result()
        new = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30)
    assert old.status_code == 200 and new.status_code == 200
    assert old.headers["x-ir-calibration"] == "tiny-balanced"
    assert new.headers["x-ir-calibration"] == "tiny-balanced-v2"
    ran = [stats.calibration_version for stats in gated.finished]
    assert ran == ["tiny-balanced", "tiny-balanced-v2"]
    event = sink.by_trace(old.headers["x-ir-trace-id"])
    assert event.calibration_version == "tiny-balanced"


# -- control listener on a real broker -------------------------------------------------------


def test_gateway_installs_published_calibrations_for_its_weights_only(
    kafka_broker: Broker, tmp_path: Path
) -> None:
    telemetry = TelemetrySettings(bootstrap_servers=kafka_broker.bootstrap, partitions=1)
    settings = Settings(home=tmp_path, telemetry=telemetry)
    engine = tiny_engine()
    registry = CollectorRegistry()
    app = create_app(settings, engine=engine, registry=registry)
    with serve(app) as url:
        control = app.state.runtime.control
        assert control is not None and control.ready.wait(30)
        _send_raw(telemetry, b"{not json")
        _send_raw(telemetry, json.dumps({"type": CALIBRATION_PUBLISHED, "calibration": {}}))
        publish_calibration(telemetry, calibration_of(engine, "other-v9", "other-sha"), "test")
        publish_calibration(telemetry, calibration_of(engine, "tiny-balanced-v2"), "drift")

        def serves_v2() -> bool:
            response = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30)
            return response.headers["x-ir-calibration"] == "tiny-balanced-v2"

        wait_until(serves_v2, timeout_s=30, every_s=0.2)
        status = httpx.get(f"{url}/admin/status").json()
        store = CalibrationStore(settings.calibrations_dir)
        assert store.load("tiny-balanced-v2").baseline is None
        # The baseline job republishes the same version with its baseline: kept, not reloaded.
        measured = calibration_of(engine, "tiny-balanced-v2")
        measured.baseline = healthy_level().to_dict()
        publish_calibration(telemetry, measured, "baseline:job-1")
        wait_until(lambda: store.load("tiny-balanced-v2").baseline is not None, 30, 0.2)
    assert store.load("tiny-balanced-v2").data == {"corpus": "test"}
    with pytest.raises(CalibrationNotFoundError):
        store.load("other-v9")
    restarted = Engine(engine.lm, store.latest_plans(engine.lm.weights_sha256))
    assert restarted.plan(Level.BALANCED).calibration_version == "tiny-balanced-v2"
    labels = {"level": "balanced"}
    assert registry.get_sample_value("sparseguard_calibration_reloads_total", labels) == 1.0
    assert status["levels"]["balanced"] == "tiny-balanced-v2"
    assert status["control_listener"] is True


def test_listener_waits_for_a_late_broker_and_survives_its_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broker = Broker()  # not started yet: the gateway comes up first
    telemetry = TelemetrySettings(bootstrap_servers=broker.bootstrap, partitions=1)
    settings = Settings(home=tmp_path, telemetry=telemetry)
    engine = tiny_engine(cache=False)
    app = create_app(settings, engine=engine)

    def serving(version: str) -> bool:
        return engine.plan(Level.BALANCED).calibration_version == version

    caplog.set_level(logging.INFO, logger="services.gateway.control_listener")
    try:
        with serve(app):
            control = app.state.runtime.control
            assert not control.ready.wait(2)  # it retried meanwhile, and logged once
            assert caplog.text.count("control topic unavailable") == 1
            broker.start()
            assert control.ready.wait(60)
            for version in ("tiny-balanced-v2", "tiny-balanced-v3"):
                publish_calibration(telemetry, calibration_of(engine, version), "test")
                wait_until(lambda: serving(version), timeout_s=60, every_s=0.2)  # noqa: B023
                broker.stop()  # memory storage: it comes back without topics or offsets
                broker.start()
    finally:
        broker.stop()
    assert "calibration of tiny-llama at balanced: tiny-balanced-v2 -> tiny-balanced-v3" in (
        caplog.text
    )


def _send_raw(telemetry: TelemetrySettings, value: bytes | str) -> None:
    producer = KafkaProducer(bootstrap_servers=telemetry.bootstrap_servers)
    try:
        data = value.encode() if isinstance(value, str) else value
        producer.send(telemetry.control_topic, value=data).get(timeout=10)
    finally:
        producer.close(timeout=5)


# -- admin endpoints -------------------------------------------------------------------------

ADMIN = {"x-api-key": "sk-admin"}
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def test_admin_recalibrate_queues_a_job_and_sends_its_task(tmp_path: Path) -> None:
    keys = {"api_key_hashes": [hash_key("sk-user")], "admin_key_hashes": [hash_key("sk-admin")]}
    settings = settings_for(tmp_path, **keys)
    with running_gateway(settings, tiny_engine(), RecordingSink()) as url:
        traced = {**ADMIN, "traceparent": f"00-{TRACE}-00f067aa0ba902b7-01"}
        queued = httpx.post(f"{url}/admin/recalibrate", json={"level": "balanced"}, headers=traced)
        job_id = queued.json()["job_id"]
        job = httpx.get(f"{url}/admin/jobs/{job_id}", headers=ADMIN)
        missing = httpx.get(f"{url}/admin/jobs/{job_id + 1}", headers=ADMIN)
        huge = httpx.get(f"{url}/admin/jobs/{2**64}", headers=ADMIN)
        dense = httpx.post(f"{url}/admin/recalibrate", json={"level": "dense"}, headers=ADMIN)
        unknown = httpx.post(f"{url}/admin/recalibrate", json={"level": "turbo"}, headers=ADMIN)
        no_body = httpx.post(f"{url}/admin/recalibrate", json={}, headers=ADMIN)
        anonymous = httpx.post(f"{url}/admin/recalibrate", json={"level": "balanced"})
        user = httpx.post(
            f"{url}/admin/recalibrate", json={"level": "balanced"}, headers={"x-api-key": "sk-user"}
        )
        user_job = httpx.get(f"{url}/admin/jobs/{job_id}", headers={"x-api-key": "sk-user"})
    assert queued.status_code == 202 and queued.json() == {"job_id": job_id, "status": "queued"}
    row = job.json()
    assert job.status_code == 200 and row["id"] == job_id
    assert (row["kind"], row["status"], row["reason"], row["attempts"]) == (
        "recalibrate",
        "queued",
        "operator",
        0,
    )
    assert row["params"] == {"level": "balanced", "model": settings.engine.model}
    assert row["created_at"] and row["started_at"] is None and row["finished_at"] is None
    assert row["trace_id"] == TRACE and row["result"] is None  # the caller's trace
    assert missing.status_code == 404 and f"no job {job_id + 1}" in missing.text
    assert huge.status_code == 400
    assert dense.status_code == 400 and "dense level has no calibration" in dense.text
    assert unknown.status_code == 400 and "unknown level 'turbo'" in unknown.text
    assert "conservative, balanced, aggressive" in unknown.text
    assert no_body.status_code == 400 and "level" in no_body.text
    assert anonymous.status_code == 401 and user.status_code == 403
    assert user_job.status_code == 403
    assert _jobs_in_table(settings) == [(job_id, "operator")]  # refused requests stored nothing
    assert _task_in_broker(settings) == ("sparseguard.recalibrate", [job_id])


def _jobs_in_table(settings: Settings) -> list[tuple[int, str]]:
    engine = make_engine(settings.database_url)
    try:
        with session_factory(engine)() as session:
            return [(job.id, job.reason) for job in session.query(JobRun).all()]
    finally:
        engine.dispose()


def _task_in_broker(settings: Settings) -> tuple[str, list[int]]:
    celery = make_celery(settings)
    with celery.connection_for_read() as connection:
        queue = connection.SimpleQueue(settings.jobs.queue)
        try:
            message = queue.get(timeout=10)
            message.ack()
        finally:
            queue.close()
    args, _kwargs, _embed = message.payload
    return message.headers["task"], args
