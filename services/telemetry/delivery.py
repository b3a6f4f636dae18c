"""The Kafka side of the telemetry producer: a cheap reachability probe, a KafkaProducer with
short timeouts, and delivery of a window of records that reports the acknowledged prefix."""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from typing import Any

from kafka import KafkaProducer
from kafka.errors import KafkaError

from services.config import TelemetrySettings
from services.telemetry.spool import OutgoingRecord

log = logging.getLogger(__name__)

DEFAULT_PORT = 9092
PROBE_TIMEOUT_S = 0.5
DELIVERY_TIMEOUT_MS = 3_000  # an outage is noticed within this; >= request timeout + linger
# Short timeouts so a dead broker is noticed in seconds, not kafka-python's 30-120 s defaults.
CLIENT_TIMEOUTS = {
    "request_timeout_ms": 2_000,
    "delivery_timeout_ms": DELIVERY_TIMEOUT_MS,
    "max_block_ms": 2_000,
    "bootstrap_timeout_ms": 2_000,
    "reconnect_backoff_ms": 100,
    "reconnect_backoff_max_ms": 1_000,
}
FLUSH_TIMEOUT_S = DELIVERY_TIMEOUT_MS / 1000 + 1.0


def servers(bootstrap_servers: str) -> list[str]:
    return [server.strip() for server in bootstrap_servers.split(",") if server.strip()]


def host_port(server: str) -> tuple[str, int]:
    host, sep, port = server.rpartition(":")
    if not sep or host.endswith(":"):  # "host" alone, or a bare IPv6 address
        return server.strip("[]"), DEFAULT_PORT
    return host.strip("[]"), int(port)


def is_reachable(bootstrap_servers: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether any bootstrap server accepts a TCP connection: a probe that costs milliseconds
    while the broker is down, where building a KafkaProducer costs its bootstrap timeout."""
    for server in servers(bootstrap_servers):
        try:
            socket.create_connection(host_port(server), timeout_s).close()
        except (OSError, ValueError):
            continue
        return True
    return False


def open_producer(settings: TelemetrySettings) -> Any:
    """A connected KafkaProducer (topic metadata fetched), or KafkaError."""
    producer = KafkaProducer(
        bootstrap_servers=servers(settings.bootstrap_servers),
        client_id=settings.client_id,
        acks="all",
        linger_ms=5,
        **CLIENT_TIMEOUTS,
    )
    try:
        producer.partitions_for(settings.topic)
    except KafkaError:
        producer.close(timeout=0)
        raise
    return producer


def deliver(producer: Any, records: Sequence[OutgoingRecord]) -> int:
    """Send and wait; returns how many records, counted from the first, were acknowledged.
    Records after the first failure count as unsent so a retry keeps their order (a record
    acknowledged after a failure may then arrive twice: delivery is at-least-once)."""
    futures: list[Any] = []
    try:
        for record in records:
            futures.append(
                producer.send(
                    record.topic, key=record.key, value=record.value, headers=record.headers
                )
            )
        producer.flush(timeout=FLUSH_TIMEOUT_S)
    except KafkaError as exc:
        log.warning("telemetry send failed: %s", exc)
    return acked_prefix(futures)


def acked_prefix(futures: Sequence[Any]) -> int:
    for index, future in enumerate(futures):
        if not future.succeeded():
            if future.failed():
                log.warning("telemetry record not acknowledged: %r", future.exception)
            return index
    return len(futures)


def close_quietly(producer: Any) -> None:
    try:
        producer.close(timeout=0)
    except Exception:  # closing a broken client must not take the producer thread down
        log.debug("closing the Kafka producer failed", exc_info=True)
