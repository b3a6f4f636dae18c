"""The Alertmanager webhook (version 4) JSON body: `AlertNotice`, one alert as a notification
reports it, and `build_payload`, the body for one group of notices sent to one receiver.

Any consumer of Alertmanager's webhook (PagerDuty/Opsgenie bridges, alert routers, chat bots)
reads it unchanged. Times are RFC 3339 in UTC; an open alert's endsAt is Go's zero time, as
Alertmanager sends it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

PAYLOAD_VERSION = "4"
ZERO_TIME = "0001-01-01T00:00:00Z"
# Alertmanager prefixes the group labels with its route's matchers; we have one route.
ROOT_ROUTE_KEY = "{}"

NoticeStatus = Literal["firing", "resolved"]


@dataclass(frozen=True, slots=True)
class AlertNotice:
    status: NoticeStatus
    labels: dict[str, str]
    annotations: dict[str, str]
    starts_at: datetime
    ends_at: datetime | None  # None while the alert is open
    fingerprint: str
    generator_url: str = ""


def build_payload(
    receiver: str,
    notices: list[AlertNotice],
    group_labels: dict[str, str],
    external_url: str,
) -> dict[str, Any]:
    """The v4 body for `notices` (one group, at least one notice) sent to `receiver`."""
    if not notices:
        raise ValueError("build_payload needs at least one notice")
    any_firing = any(notice.status == "firing" for notice in notices)
    return {
        "version": PAYLOAD_VERSION,
        "groupKey": group_key(group_labels),
        "truncatedAlerts": 0,
        "status": "firing" if any_firing else "resolved",
        "receiver": receiver,
        "groupLabels": dict(group_labels),
        "commonLabels": _common([notice.labels for notice in notices]),
        "commonAnnotations": _common([notice.annotations for notice in notices]),
        "externalURL": external_url,
        "alerts": [_alert(notice) for notice in notices],
    }


def group_key(group_labels: dict[str, str]) -> str:
    """Alertmanager's group key: the route key, then the group labels sorted, values quoted."""
    pairs = ", ".join(f"{name}={json.dumps(group_labels[name])}" for name in sorted(group_labels))
    return f"{ROOT_ROUTE_KEY}:{{{pairs}}}"


def rfc3339(moment: datetime) -> str:
    """`moment` in UTC as RFC 3339 with a "Z" suffix; naive datetimes are refused."""
    if moment.tzinfo is None:
        raise ValueError(f"naive datetime {moment!r}: pass a timezone-aware (UTC) datetime")
    return moment.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _alert(notice: AlertNotice) -> dict[str, Any]:
    return {
        "status": notice.status,
        "labels": dict(notice.labels),
        "annotations": dict(notice.annotations),
        "startsAt": rfc3339(notice.starts_at),
        "endsAt": ZERO_TIME if notice.ends_at is None else rfc3339(notice.ends_at),
        "generatorURL": notice.generator_url,
        "fingerprint": notice.fingerprint,
    }


def _common(mappings: list[dict[str, str]]) -> dict[str, str]:
    """The name/value pairs every mapping shares."""
    first, *rest = mappings
    return {
        name: value
        for name, value in first.items()
        if all(other.get(name) == value for other in rest)
    }
