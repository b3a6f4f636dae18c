"""The persisted webhook outbox over `WebhookDelivery` rows: `enqueue` a notification in the
caller's transaction, `claim_due` the rows whose time has come, and `record_attempt` what a POST
did — delivered, retried with jittered exponential back-off, failed for good, or the receiver
disabled because it answered 410 Gone.

Enqueueing writes a row and nothing else, so the caller commits it together with the alert
state change: a crash loses either both or neither, and the dispatcher (any process) delivers
what was committed. Delivery is at-least-once; receivers dedupe on the `webhook-id` header,
`message_id(row)`, which stays the same across retries.

A receiver is disabled while any of its rows is `disabled` (there is no receivers table)."""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, cast

from sqlalchemy import CursorResult, Select, Update, func, select, update
from sqlalchemy.orm import Session

from services.config import AlertSettings
from services.storage.models import WebhookDelivery, utcnow

Verdict = Literal["delivered", "retry", "failed", "disabled"]
GONE = 410
MAX_ERROR_CHARS = 500
DISABLED_ERROR = "receiver disabled: it answered 410 Gone"
# Fixed namespace for webhook-ids: uuid5 of the row's identity (see message_id).
MESSAGE_NAMESPACE = uuid.UUID("6f1d6c1e-7a2b-5c55-9d0e-5350415253ff")


@dataclass(frozen=True, slots=True)
class AttemptResult:
    """What one POST got: an HTTP status, or None when no answer came (time-out, refused)."""

    status_code: int | None
    error: str = ""  # why it failed; the caller keeps secrets out of it

    @property
    def is_delivered(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300

    @property
    def is_gone(self) -> bool:
        return self.status_code == GONE


def enqueue(
    session: Session,
    receiver: str,
    fingerprint: str,
    payload: dict[str, Any],
    now: datetime | None = None,
) -> int:
    """Add one notification for `receiver` (due at once, or `disabled` if the receiver is);
    returns its id. The caller commits, in the transaction that changed the alert."""
    now = utcnow() if now is None else now
    is_disabled = receiver in disabled_receivers(session)
    row = WebhookDelivery(
        receiver=receiver,
        alert_fingerprint=fingerprint,
        payload=payload,
        status="disabled" if is_disabled else "pending",
        attempts=0,
        next_attempt_at=now,
        last_error=DISABLED_ERROR if is_disabled else None,
        created_at=now,
    )
    session.add(row)
    session.flush()
    return row.id


def claim_due(
    session: Session, now: datetime, limit: int, lease: timedelta
) -> list[WebhookDelivery]:
    """Pending rows whose next attempt is at or before `now`, oldest first, each with its next
    attempt pushed `lease` ahead, so other dispatchers skip it until this one records the
    attempt — or, if this one dies, until the lease runs out.
    PostgreSQL skips rows another transaction is claiming; SQLite serialises writers anyway."""
    rows = list(session.scalars(_due_query(now, limit).with_for_update(skip_locked=True)))
    for row in rows:
        row.next_attempt_at = now + lease
    return rows


def message_id(delivery: WebhookDelivery) -> str:
    """The row's `webhook-id`: "msg_" + a UUID derived from its id, alert and creation time.
    Stable across retries (and dispatchers) without a column of its own; the creation time
    keeps it unique when a fresh database reuses row ids."""
    created = delivery.created_at.astimezone(UTC).isoformat()
    identity = f"{delivery.id}:{delivery.alert_fingerprint}:{created}"
    return f"msg_{uuid.uuid5(MESSAGE_NAMESPACE, identity).hex}"


def record_attempt(
    session: Session,
    delivery: WebhookDelivery,
    result: AttemptResult,
    now: datetime,
    settings: AlertSettings,
    rng: random.Random | None = None,
) -> Verdict:
    """Apply one POST's result to `delivery` (the caller commits); returns what became of it."""
    delivery.attempts += 1
    if result.is_delivered:
        delivery.status = "delivered"
        delivery.delivered_at = now
        delivery.last_error = None
        return "delivered"
    if result.is_gone:
        disable_receiver(session, delivery)
        return "disabled"
    delivery.last_error = _clip(result.error or f"HTTP {result.status_code}")
    if delivery.attempts >= settings.max_attempts:
        delivery.status = "failed"
        return "failed"
    delay = backoff_s(delivery.attempts, settings, rng or random.Random())
    delivery.next_attempt_at = now + timedelta(seconds=delay)
    return "retry"


def backoff_s(attempts: int, settings: AlertSettings, rng: random.Random) -> float:
    """The wait after the `attempts`-th failed attempt (1, 2, ...): the exponential step
    base·2^(attempts-1), capped at the maximum, times a jitter factor drawn from [0.5, 1]."""
    step = min(settings.backoff_max_s, settings.backoff_base_s * 2.0 ** (attempts - 1))
    return step * rng.uniform(0.5, 1.0)


def mark_failed(delivery: WebhookDelivery, error: str) -> Verdict:
    """Give up on `delivery` without an attempt (e.g. its receiver is not configured)."""
    delivery.status = "failed"
    delivery.last_error = _clip(error)
    return "failed"


def disable_receiver(session: Session, delivery: WebhookDelivery) -> int:
    """Disable `delivery` and every other pending row of its receiver; returns how many."""
    delivery.status = "disabled"
    delivery.last_error = DISABLED_ERROR
    session.flush()
    others = (
        update(WebhookDelivery)
        .where(
            WebhookDelivery.receiver == delivery.receiver,
            WebhookDelivery.status == "pending",
        )
        .values(status="disabled", last_error=DISABLED_ERROR)
    )
    return 1 + _rowcount(session, others)


def disabled_receivers(session: Session) -> set[str]:
    """Receivers that answered 410 Gone and have not been enabled again."""
    query = select(WebhookDelivery.receiver).where(WebhookDelivery.status == "disabled").distinct()
    return set(session.scalars(query))


def pending_count(session: Session) -> int:
    query = select(func.count()).select_from(WebhookDelivery)
    return session.scalar(query.where(WebhookDelivery.status == "pending")) or 0


def _due_query(now: datetime, limit: int) -> Select[WebhookDelivery]:
    return (
        select(WebhookDelivery)
        .where(WebhookDelivery.status == "pending", WebhookDelivery.next_attempt_at <= now)
        .order_by(WebhookDelivery.next_attempt_at, WebhookDelivery.id)
        .limit(limit)
    )


def _rowcount(session: Session, statement: Update) -> int:
    # "fetch" also updates the rows this session already holds, so callers see the change.
    result = session.execute(statement, execution_options={"synchronize_session": "fetch"})
    return cast(CursorResult[Any], result).rowcount


def _clip(error: str) -> str:
    return error if len(error) <= MAX_ERROR_CHARS else error[: MAX_ERROR_CHARS - 1] + "…"
