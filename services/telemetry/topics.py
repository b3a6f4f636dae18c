"""The topics SparseGuard uses and an idempotent `ensure_topics` that creates missing ones."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kafka import KafkaAdminClient
from kafka.errors import TopicAlreadyExistsError, for_code

from services.config import TelemetrySettings

log = logging.getLogger(__name__)

ADMIN_TIMEOUT_MS = 5_000


@dataclass(frozen=True, slots=True)
class TopicSpec:
    name: str
    partitions: int
    replication_factor: int = 1


def topic_specs(settings: TelemetrySettings) -> list[TopicSpec]:
    """Telemetry is partitioned by model|level; control and dead-letter need one partition."""
    return [
        TopicSpec(settings.topic, settings.partitions),
        TopicSpec(settings.control_topic, 1),
        TopicSpec(settings.dead_letter_topic, 1),
    ]


def ensure_topics(bootstrap_servers: str, specs: Sequence[TopicSpec]) -> None:
    """Create the topics that do not exist yet; existing ones are left as they are (a partition
    count that differs from the spec is logged, not changed). Raises KafkaError when the
    cluster cannot be reached."""
    admin = KafkaAdminClient(
        bootstrap_servers=bootstrap_servers.split(","),
        request_timeout_ms=ADMIN_TIMEOUT_MS,
        bootstrap_timeout_ms=ADMIN_TIMEOUT_MS,
    )
    try:
        existing = set(admin.list_topics())
        _warn_on_mismatch(admin, [spec for spec in specs if spec.name in existing])
        missing = [spec for spec in specs if spec.name not in existing]
        if missing:
            _create(admin, missing)
    finally:
        admin.close()


def _create(admin: Any, specs: Sequence[TopicSpec]) -> None:
    request = {
        spec.name: {
            "num_partitions": spec.partitions,
            "replication_factor": spec.replication_factor,
        }
        for spec in specs
    }
    response = admin.create_topics(request, timeout_ms=ADMIN_TIMEOUT_MS, raise_errors=False)
    for topic in response["topics"]:
        error = for_code(topic["error_code"])
        if topic["error_code"] and error is not TopicAlreadyExistsError:
            raise error(f"creating topic {topic['name']}: {topic['error_message']}")
    log.info("created topics %s", ", ".join(sorted(request)))


def _warn_on_mismatch(admin: Any, specs: Sequence[TopicSpec]) -> None:
    if not specs:
        return
    wanted = {spec.name: spec.partitions for spec in specs}
    for topic in admin.describe_topics([spec.name for spec in specs]):
        found = len(topic.get("partitions") or [])
        if topic.get("name") in wanted and found != wanted[topic["name"]]:
            log.warning(
                "topic %s has %d partitions, expected %d",
                topic["name"],
                found,
                wanted[topic["name"]],
            )
