"""Webhook delivery end to end: the outbox in a migrated SQLite file, `WebhookDispatcher` with a
real `httpx.AsyncClient`, and a real HTTP receiver on loopback that verifies every Standard
Webhooks signature and answers as told (500 a few times, 410, slowly). The clock is driven by
the test; the receiver checks timestamps against that same clock."""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from pydantic import SecretStr
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from alerts.payload import AlertNotice, build_payload
from services.alerting import outbox
from services.alerting.webhooks import WebhookDispatcher
from services.config import AlertSettings, WebhookReceiver
from services.shared.serving import free_port, serve
from services.storage.db import make_engine, session_factory, upgrade
from services.storage.models import AlertRecord, WebhookDelivery
from tests.webhook_receiver import (
    EXTERNAL_URL,
    SECRETS,
    T0,
    Clock,
    Receivers,
    Slot,
    alert_record,
    receiver_app,
)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[Slot, str]]:
    slot = Slot()
    with serve(receiver_app(slot)) as url:
        yield slot, url


@pytest.fixture
def far_side(server: tuple[Slot, str]) -> Receivers:
    server[0].current = Receivers()
    return server[0].current


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'sparseguard.db'}"
    upgrade(url)
    return url


@pytest.fixture
def sessions(db_url: str) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(db_url)
    yield session_factory(engine)
    engine.dispose()


def settings_for(server: tuple[Slot, str], *names: str, **knobs: Any) -> AlertSettings:
    url = server[1]
    receivers = [
        WebhookReceiver(name=n, url=f"{url}/hooks/{n}", secret=SecretStr(SECRETS[n]), timeout_s=1)
        for n in names
    ]
    return AlertSettings(receivers=receivers, **knobs)


def notice(fingerprint: str, status: str = "firing") -> AlertNotice:
    return AlertNotice(
        status="firing" if status == "firing" else "resolved",
        labels={"alertname": "SparsityCollapse", "model": "smollm2", "level": "balanced"},
        annotations={"summary": "sparsity fell below 40%"},
        starts_at=T0 - timedelta(minutes=5),
        ends_at=None if status == "firing" else T0,
        fingerprint=fingerprint,
        generator_url=f"{EXTERNAL_URL}/alerts",
    )


def enqueue(sessions: sessionmaker[Session], receiver: str, fingerprint: str = "fp1") -> int:
    payload = build_payload(receiver, [notice(fingerprint)], {"alertname": "X"}, EXTERNAL_URL)
    with sessions.begin() as session:
        return outbox.enqueue(session, receiver, fingerprint, payload, now=T0)


def row(sessions: sessionmaker[Session], row_id: int) -> WebhookDelivery:
    with sessions() as session:
        found = session.get(WebhookDelivery, row_id)
    if found is None:
        raise LookupError(f"no outbox row {row_id}")
    return found


def count(registry: CollectorRegistry, receiver: str, outcome: str) -> float | None:
    labels = {"receiver": receiver, "outcome": outcome}
    return registry.get_sample_value("sparseguard_webhook_deliveries_total", labels)


@asynccontextmanager
async def dispatcher(
    settings: AlertSettings,
    sessions: sessionmaker[Session],
    registry: CollectorRegistry,
    clock: Clock,
    rng: random.Random | None = None,
) -> AsyncIterator[WebhookDispatcher]:
    async with httpx.AsyncClient() as client:
        yield WebhookDispatcher(settings, sessions, client, registry, rng=rng, clock=clock)


def test_delivers_a_signed_alertmanager_v4_body(
    server: tuple[Slot, str], far_side: Receivers, sessions: sessionmaker[Session]
) -> None:
    registry = CollectorRegistry()
    first, second = enqueue(sessions, "ops", "fp1"), enqueue(sessions, "ops", "fp2")

    async def scenario() -> None:
        async with dispatcher(settings_for(server, "ops"), sessions, registry, far_side.clock) as d:
            assert await d.deliver_due(limit=1) == 1
            assert registry.get_sample_value("sparseguard_webhook_outbox_pending") == 1
            assert await d.deliver_due() == 1

    asyncio.run(scenario())
    assert far_side.rejected == []
    hit = far_side.sent_to("ops")[0]
    assert hit.body == row(sessions, first).payload
    assert hit.body["version"] == "4" and hit.body["status"] == "firing"
    assert hit.body["alerts"][0]["endsAt"] == "0001-01-01T00:00:00Z"
    assert hit.headers["content-type"] == "application/json"
    assert hit.headers["webhook-id"].startswith("msg_")
    assert hit.headers["webhook-timestamp"] == str(int(T0.timestamp()))
    assert hit.headers["webhook-id"] != far_side.sent_to("ops")[1].headers["webhook-id"]
    for row_id in (first, second):
        assert (row(sessions, row_id).status, row(sessions, row_id).delivered_at) == (
            "delivered",
            T0,
        )
    assert count(registry, "ops", "delivered") == 2
    assert registry.get_sample_value("sparseguard_webhook_outbox_pending") == 0


def test_retries_with_exponential_back_off_then_delivers(
    server: tuple[Slot, str], far_side: Receivers, sessions: sessionmaker[Session]
) -> None:
    settings = settings_for(server, "ops", backoff_base_s=2.0, backoff_max_s=10.0)
    failures = [500, 503, 429, 500]
    far_side.answers["ops"] = [*failures, 200]
    registry, clock, twin = CollectorRegistry(), far_side.clock, random.Random(7)
    row_id = enqueue(sessions, "ops")

    async def scenario() -> None:
        async with dispatcher(settings, sessions, registry, clock, random.Random(7)) as d:
            steps = [2.0, 4.0, 8.0, 10.0]  # base 2 s doubling, capped at 10 s
            for attempt, (code, step) in enumerate(zip(failures, steps, strict=True), start=1):
                assert await d.deliver_due() == 1
                waiting = row(sessions, row_id)
                assert (waiting.status, waiting.attempts) == ("pending", attempt)
                assert waiting.last_error == f"HTTP {code}: internal error"
                delay = (waiting.next_attempt_at - clock.now).total_seconds()
                assert step / 2 <= delay <= step  # the capped exponential step, jittered
                assert delay == pytest.approx(step * twin.uniform(0.5, 1.0), abs=1e-5)
                clock.now = waiting.next_attempt_at - timedelta(milliseconds=1)
                assert await d.deliver_due() == 0  # not due yet
                clock.now = waiting.next_attempt_at
            assert await d.deliver_due() == 1

    asyncio.run(scenario())
    done = row(sessions, row_id)
    assert (done.status, done.attempts, done.delivered_at) == ("delivered", 5, clock.now)
    assert len({hit.headers["webhook-id"] for hit in far_side.hits}) == 1  # stable for dedupe
    assert far_side.rejected == []
    assert (count(registry, "ops", "retry"), count(registry, "ops", "delivered")) == (4, 1)


def test_gone_disables_the_receiver_and_its_pending_rows(
    server: tuple[Slot, str], far_side: Receivers, sessions: sessionmaker[Session]
) -> None:
    settings, registry = settings_for(server, "gone", "ops"), CollectorRegistry()
    far_side.answers["gone"] = [410]
    gone_ids = [enqueue(sessions, "gone", "fp1"), enqueue(sessions, "gone", "fp2")]
    ops_id = enqueue(sessions, "ops", "fp1")

    async def scenario() -> None:
        async with dispatcher(settings, sessions, registry, far_side.clock) as d:
            assert await d.deliver_due() == 2  # the second "gone" row is never tried
            late_id = enqueue(sessions, "gone", "fp3")
            assert row(sessions, late_id).status == "disabled"
            assert await d.deliver_due() == 0

    with sessions() as session:
        assert outbox.disabled_receivers(session) == set()
    asyncio.run(scenario())
    assert len(far_side.sent_to("gone")) == 1
    assert [row(sessions, i).status for i in gone_ids] == ["disabled", "disabled"]
    assert row(sessions, ops_id).status == "delivered"
    with sessions() as session:
        assert outbox.disabled_receivers(session) == {"gone"}
    assert count(registry, "gone", "disabled") == 1
    assert count(registry, "ops", "delivered") == 1


def test_disabled_receiver_is_remembered_in_the_database(
    server: tuple[Slot, str], far_side: Receivers, sessions: sessionmaker[Session]
) -> None:
    far_side.answers["gone"] = [410]
    first, second = enqueue(sessions, "gone", "fp1"), enqueue(sessions, "gone", "fp2")
    settings = settings_for(server, "gone")

    async def scenario() -> None:
        async with dispatcher(settings, sessions, CollectorRegistry(), far_side.clock) as d:
            await d.deliver_due()

    asyncio.run(scenario())
    with sessions() as session:
        assert outbox.disabled_receivers(session) == {"gone"}
    assert [row(sessions, i).status for i in (first, second)] == ["disabled", "disabled"]
    assert row(sessions, first).attempts == 1 and row(sessions, second).attempts == 0
    assert "410" in (row(sessions, second).last_error or "")


def test_gives_up_after_max_attempts_and_never_leaks_the_secret(
    server: tuple[Slot, str],
    far_side: Receivers,
    sessions: sessionmaker[Session],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    settings, registry = settings_for(server, "ops", max_attempts=3), CollectorRegistry()
    far_side.answers["ops"] = [500]
    far_side.error_body = f"bad config, secret is {SECRETS['ops']}"  # a receiver echoing it
    row_id = enqueue(sessions, "ops")

    async def scenario() -> None:
        async with dispatcher(settings, sessions, registry, far_side.clock) as d:
            for _ in range(3):
                assert await d.deliver_due() == 1
                far_side.clock.now = row(sessions, row_id).next_attempt_at
            assert await d.deliver_due() == 0

    asyncio.run(scenario())
    failed = row(sessions, row_id)
    assert (failed.status, failed.attempts) == ("failed", 3)
    assert failed.last_error == "HTTP 500: bad config, secret is ***"
    assert (count(registry, "ops", "retry"), count(registry, "ops", "failed")) == (2, 1)
    key = SECRETS["ops"].removeprefix("whsec_")
    assert key not in caplog.text and key not in json.dumps(failed.payload)


def test_connection_errors_and_time_outs_are_retried(
    server: tuple[Slot, str], far_side: Receivers, sessions: sessionmaker[Session]
) -> None:
    settings = settings_for(server, "down", "slow")
    settings.receivers[0].url = f"http://127.0.0.1:{free_port()}/hooks/down"
    settings.receivers[1].timeout_s = 0.1
    far_side.delay_s = 0.5
    registry = CollectorRegistry()
    down_id, slow_id = enqueue(sessions, "down"), enqueue(sessions, "slow")

    async def scenario() -> None:
        async with dispatcher(settings, sessions, registry, far_side.clock) as d:
            assert await d.deliver_due() == 2

    asyncio.run(scenario())
    assert (row(sessions, down_id).last_error or "").startswith("ConnectError")
    assert (row(sessions, slow_id).last_error or "").startswith("ReadTimeout")
    assert all(row(sessions, i).status == "pending" for i in (down_id, slow_id))
    assert count(registry, "down", "retry") == count(registry, "slow", "retry") == 1


def test_unknown_receiver_fails_with_a_clear_error(
    server: tuple[Slot, str], far_side: Receivers, sessions: sessionmaker[Session]
) -> None:
    registry, row_id = CollectorRegistry(), enqueue(sessions, "ghost")

    async def scenario() -> None:
        async with dispatcher(settings_for(server, "ops"), sessions, registry, far_side.clock) as d:
            assert await d.deliver_due() == 1

    asyncio.run(scenario())
    failed = row(sessions, row_id)
    assert failed.status == "failed"
    assert failed.last_error == "receiver 'ghost' is not configured (alerts.receivers)"
    assert count(registry, "ghost", "failed") == 1 and far_side.hits == []


def test_a_notification_committed_before_a_crash_is_delivered_after_restart(
    server: tuple[Slot, str], far_side: Receivers, db_url: str
) -> None:
    """The outbox row commits with the alert change or not at all; a new process (new engine,
    session factory, dispatcher) delivers what was committed."""
    crashed = make_engine(db_url)
    before = session_factory(crashed)
    payload = build_payload("ops", [notice("fp1")], {"alertname": "X"}, EXTERNAL_URL)
    with before.begin() as session:
        session.add(alert_record("fp1"))
        outbox.enqueue(session, "ops", "fp1", payload, now=T0)
    with pytest.raises(RuntimeError), before.begin() as session:
        session.add(alert_record("fp2"))
        outbox.enqueue(session, "ops", "fp2", payload, now=T0)
        raise RuntimeError("crash before commit")
    crashed.dispose()

    engine = make_engine(db_url)
    after, registry = session_factory(engine), CollectorRegistry()

    async def scenario() -> None:
        async with dispatcher(settings_for(server, "ops"), after, registry, far_side.clock) as d:
            assert await d.deliver_due() == 1

    asyncio.run(scenario())
    with after() as session:
        assert session.scalars(select(AlertRecord.fingerprint)).all() == ["fp1"]
        assert session.scalars(select(WebhookDelivery.status)).all() == ["delivered"]
    engine.dispose()
    assert [hit.body for hit in far_side.hits] == [payload]


def test_a_claim_by_a_dispatcher_that_died_is_retaken_after_the_lease(
    server: tuple[Slot, str], far_side: Receivers, sessions: sessionmaker[Session]
) -> None:
    row_id = enqueue(sessions, "ops")
    with sessions.begin() as session:  # another dispatcher claims the row, then dies
        assert len(outbox.claim_due(session, T0, 10, timedelta(seconds=65))) == 1

    async def scenario() -> None:
        clock = far_side.clock
        async with dispatcher(
            settings_for(server, "ops"), sessions, CollectorRegistry(), clock
        ) as d:
            clock.now = T0 + timedelta(seconds=64)
            assert await d.deliver_due() == 0
            clock.now = T0 + timedelta(seconds=65)
            assert await d.deliver_due() == 1

    asyncio.run(scenario())
    assert row(sessions, row_id).status == "delivered"


def test_a_malformed_secret_stops_the_dispatcher_without_showing_it(
    server: tuple[Slot, str], sessions: sessionmaker[Session]
) -> None:
    settings = settings_for(server, "ops")
    settings.receivers[0].secret = SecretStr("not-a-whsec-secret-A1B2")

    async def scenario() -> None:
        async with dispatcher(settings, sessions, CollectorRegistry(), Clock()):
            pass

    with pytest.raises(ValueError, match="receiver 'ops': webhook secret must start") as caught:
        asyncio.run(scenario())
    assert "A1B2" not in str(caught.value)


def test_payload_follows_alertmanager_v4() -> None:
    other = AlertNotice(
        status="resolved",
        labels={"alertname": "SparsityCollapse", "model": "qwen", "level": "balanced"},
        annotations={"summary": "sparsity fell below 40%", "runbook": "r"},
        starts_at=T0.astimezone(tz=None),
        ends_at=T0 + timedelta(seconds=1, microseconds=500),
        fingerprint="fp2",
    )
    group = {"model": "smollm2", "alertname": 'Sparsity "collapse"'}
    body = build_payload("ops", [notice("fp1"), other], group, EXTERNAL_URL)
    assert body["groupKey"] == '{}:{alertname="Sparsity \\"collapse\\"", model="smollm2"}'
    assert (body["status"], body["truncatedAlerts"], body["receiver"]) == ("firing", 0, "ops")
    assert body["commonLabels"] == {"alertname": "SparsityCollapse", "level": "balanced"}
    assert body["commonAnnotations"] == {"summary": "sparsity fell below 40%"}
    assert body["alerts"][1]["startsAt"] == "2025-06-01T12:00:00Z"
    assert body["alerts"][1]["endsAt"] == "2025-06-01T12:00:01.000500Z"
    assert build_payload("ops", [other], {}, EXTERNAL_URL)["status"] == "resolved"
    with pytest.raises(ValueError, match="at least one notice"):
        build_payload("ops", [], {}, EXTERNAL_URL)
    with pytest.raises(ValueError, match="naive datetime"):
        build_payload("ops", [notice("fp1"), _naive(other)], {}, EXTERNAL_URL)


def _naive(base: AlertNotice) -> AlertNotice:
    return AlertNotice("resolved", {}, {}, T0.replace(tzinfo=None), None, "fp3", base.generator_url)
