"""`WebhookDispatcher`: delivers due outbox rows to their receivers as signed POSTs (Alertmanager
v4 JSON, Standard Webhooks headers) and records each attempt, one commit per row.

Database work runs in worker threads (`asyncio.to_thread`), each step in its own short session,
so a slow database never stalls the event loop that the HTTP client shares. A receiver's secret
is used only to sign: it is scrubbed from every error text before that is logged or stored."""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge
from sqlalchemy.orm import Session, sessionmaker

from alerts import signing
from services.alerting import outbox
from services.alerting.outbox import AttemptResult, Verdict
from services.config import AlertSettings, WebhookReceiver
from services.shared.metrics_table import MetricSpec, declare
from services.storage.models import WebhookDelivery, utcnow

log = logging.getLogger(__name__)

# A claimed row is retaken by another dispatcher if this one has not recorded its attempt
# within the slowest receiver's time-out plus this margin (i.e. it died mid-delivery).
LEASE_MARGIN_S = 60.0
MAX_BODY_IN_ERROR = 200
REDACTED = "***"

METRICS = (
    MetricSpec(
        "webhook_deliveries_total",
        Counter,
        "Webhook delivery attempts by receiver and outcome (delivered, retry, failed, disabled).",
        ("receiver", "outcome"),
    ),
    MetricSpec("webhook_outbox_pending", Gauge, "Webhook notifications waiting to be delivered."),
)


@dataclass(frozen=True, slots=True)
class Delivery:
    """A claimed row, copied out of its session."""

    id: int
    receiver: str
    message_id: str
    payload: dict[str, Any]


class WebhookDispatcher:
    def __init__(
        self,
        settings: AlertSettings,
        sessions: sessionmaker[Session],
        client: httpx.AsyncClient,
        registry: CollectorRegistry,
        rng: random.Random | None = None,
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        for receiver in settings.receivers:
            _check_secret(receiver)
        self._settings = settings
        self._receivers = {receiver.name: receiver for receiver in settings.receivers}
        self._sessions = sessions
        self._client = client
        self._rng = rng or random.Random()
        self._clock = clock or utcnow
        slowest_s = max((receiver.timeout_s for receiver in settings.receivers), default=0.0)
        self._lease = timedelta(seconds=slowest_s + LEASE_MARGIN_S)
        metrics = declare(registry, METRICS)
        self._deliveries = cast(Counter, metrics["webhook_deliveries_total"])
        self._pending = cast(Gauge, metrics["webhook_outbox_pending"])

    async def deliver_due(self, limit: int = 100) -> int:
        """Attempt up to `limit` due rows, oldest first; returns how many were attempted."""
        attempted = 0
        while attempted < limit:
            job = await asyncio.to_thread(self._claim_next, self._clock())
            if job is None:
                break
            await self._deliver(job)
            attempted += 1
        await asyncio.to_thread(self._refresh_pending)
        return attempted

    async def _deliver(self, job: Delivery) -> None:
        receiver = self._receivers.get(job.receiver)
        if receiver is None:
            error = f"receiver {job.receiver!r} is not configured (alerts.receivers)"
            log.error("webhook %d: %s; giving up", job.id, error)
            verdict = await asyncio.to_thread(self._record_unknown, job.id, error)
        else:
            now = self._clock()
            result = await self._post(receiver, job, now)
            verdict = await asyncio.to_thread(self._record, job.id, result, now)
            _log_attempt(job, result, verdict)
        if verdict is not None:
            self._deliveries.labels(receiver=job.receiver, outcome=verdict).inc()

    async def _post(self, receiver: WebhookReceiver, job: Delivery, now: datetime) -> AttemptResult:
        secret = receiver.secret.get_secret_value()
        body = json.dumps(job.payload, separators=(",", ":"), ensure_ascii=False).encode()
        headers = signing.headers(secret, job.message_id, int(now.timestamp()), body)
        headers["content-type"] = "application/json"
        try:
            response = await self._client.post(
                receiver.url, content=body, headers=headers, timeout=receiver.timeout_s
            )
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            return AttemptResult(None, _redact(_describe(exc), secret))
        if response.is_success:
            return AttemptResult(response.status_code)
        error = f"HTTP {response.status_code}: {response.text[:MAX_BODY_IN_ERROR]}".rstrip(": ")
        return AttemptResult(response.status_code, _redact(error, secret))

    def _claim_next(self, now: datetime) -> Delivery | None:
        with self._sessions.begin() as session:
            rows = outbox.claim_due(session, now, 1, self._lease)
            if not rows:
                return None
            row = rows[0]
            return Delivery(row.id, row.receiver, outbox.message_id(row), dict(row.payload))

    def _record(self, row_id: int, result: AttemptResult, now: datetime) -> Verdict | None:
        with self._sessions.begin() as session:
            row = session.get(WebhookDelivery, row_id)
            if row is None:  # deleted while we posted: nothing left to record
                return None
            return outbox.record_attempt(session, row, result, now, self._settings, self._rng)

    def _record_unknown(self, row_id: int, error: str) -> Verdict | None:
        with self._sessions.begin() as session:
            row = session.get(WebhookDelivery, row_id)
            return None if row is None else outbox.mark_failed(row, error)

    def _refresh_pending(self) -> None:
        with self._sessions() as session:
            self._pending.set(outbox.pending_count(session))


def _check_secret(receiver: WebhookReceiver) -> None:
    try:
        signing.secret_key(receiver.secret.get_secret_value())
    except ValueError as exc:
        raise ValueError(f"webhook receiver {receiver.name!r}: {exc}") from None


def _describe(exc: Exception) -> str:
    detail = str(exc)
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__


def _redact(text: str, secret: str) -> str:
    """`text` with the secret, and its base64 key on its own, replaced."""
    for form in (secret, secret.removeprefix(signing.SECRET_PREFIX)):
        text = text.replace(form, REDACTED)
    return text


def _log_attempt(job: Delivery, result: AttemptResult, verdict: Verdict | None) -> None:
    if verdict == "delivered":
        log.info("webhook %d delivered to %s", job.id, job.receiver)
    elif verdict is not None:
        log.warning("webhook %d to %s: %s (%s)", job.id, job.receiver, result.error, verdict)
