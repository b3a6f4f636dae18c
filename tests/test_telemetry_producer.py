"""Integration tests of TelemetryProducer against a real broker (Tansu, memory storage):
delivery with key and CloudEvents headers, an outage mid-traffic with spool and ordered replay,
replay of a spool left by an earlier process, and the spool's byte bound."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from kafka import KafkaConsumer

from services.config import TelemetrySettings
from services.telemetry.broker import Broker
from services.telemetry.producer import TelemetryProducer
from services.telemetry.schema import TelemetryEvent, parse_event, partition_key
from services.telemetry.spool import OutgoingRecord, Spool, SpoolLockedError
from services.telemetry.topics import ensure_topics, topic_specs

log = logging.getLogger(__name__)

MODELS = ["smollm2-135m", "qwen2-0.5b"]
LEVELS = ["balanced", "aggressive"]


def settings_for(broker: Broker, **overrides: Any) -> TelemetrySettings:
    return TelemetrySettings(bootstrap_servers=broker.bootstrap, partitions=3, **overrides)


def make_event(index: int, run: str = "t") -> TelemetryEvent:
    return TelemetryEvent(
        trace_id=f"{run}-{index:05d}",
        time=datetime.now(UTC),
        model=MODELS[index % 2],
        calibration_version="cal-1",
        level=LEVELS[(index // 2) % 2],
        mode="serve",
        api="openai",
        status="ok",
        prompt_tokens=index,
        sparsity_per_layer=[0.4] * 30,
    )


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)
    return time.monotonic() - start


def open_consumer(broker: Broker, topic: str) -> Any:
    consumer = KafkaConsumer(
        topic,
        bootstrap_servers=broker.bootstrap,
        group_id=f"test-{uuid.uuid4().hex}",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        session_timeout_ms=6000,
        heartbeat_interval_ms=500,
    )
    return consumer


def poll_until(consumer: Any, count: int, timeout_s: float = 20.0) -> list[Any]:
    """Records until `count` arrived, plus whatever else turns up within a short grace period
    (so that a duplicate would be seen)."""
    records: list[Any] = []
    deadline = time.monotonic() + timeout_s
    while len(records) < count and time.monotonic() < deadline:
        for batch in consumer.poll(timeout_ms=200).values():
            records.extend(batch)
    for batch in consumer.poll(timeout_ms=500).values():
        records.extend(batch)
    return records


def consume(broker: Broker, topic: str, count: int) -> list[Any]:
    consumer = open_consumer(broker, topic)
    try:
        return poll_until(consumer, count)
    finally:
        consumer.close()


def ids_by_key(pairs: list[tuple[bytes, str]]) -> dict[bytes, list[str]]:
    grouped: dict[bytes, list[str]] = defaultdict(list)
    for key, trace_id in pairs:
        grouped[key].append(trace_id)
    return dict(grouped)


def received(records: list[Any]) -> list[tuple[bytes, str]]:
    return [(r.key, parse_event(r.value, r.headers).trace_id) for r in records]


class Traffic:
    """A thread sending one event every `interval_s`, like a gateway under steady load."""

    def __init__(self, producer: TelemetryProducer, interval_s: float = 0.002) -> None:
        self.producer = producer
        self.interval_s = interval_s
        self.sent: list[tuple[bytes, str]] = []
        self._running = threading.Event()
        self._stopped = threading.Event()
        self._sending = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.is_set():
            if self._running.wait(0.05):
                self._send_one()
                time.sleep(self.interval_s)

    def _send_one(self) -> None:
        with self._sending:
            if self._running.is_set():
                event = make_event(len(self.sent), "outage")
                self.producer.send(event)
                self.sent.append((partition_key(event), event.trace_id))

    def resume(self) -> None:
        self._running.set()

    def pause(self) -> None:
        """Returns once no send is in progress and none will start."""
        self._running.clear()
        with self._sending:
            pass

    def stop(self) -> None:
        self.pause()
        self._stopped.set()
        self._thread.join()

    def wait_for(self, count: int) -> None:
        wait_until(lambda: len(self.sent) >= count, 20, f"{count} events sent")


def test_events_arrive_with_key_and_headers(kafka_broker: Broker, tmp_path: Path) -> None:
    settings = settings_for(kafka_broker)
    producer = TelemetryProducer(settings, tmp_path / "spool")
    events = [make_event(i) for i in range(20)]
    for event in events:
        producer.send(event)
    assert producer.flush(10)
    records = consume(kafka_broker, settings.topic, len(events))
    producer.close()

    by_id = {event.trace_id: event for event in events}
    assert sorted(parse_event(r.value, r.headers).trace_id for r in records) == sorted(by_id)
    for record in records:
        event = by_id[dict(record.headers)["ce_id"].decode()]
        assert record.key == partition_key(event)
        assert parse_event(record.value, record.headers) == event
    stats = producer.stats()
    assert (stats.sent, stats.spooled, stats.dropped, stats.connected) == (20, 0, 0, False)


def test_outage_mid_traffic_spools_and_replays_in_order(
    kafka_broker: Broker, tmp_path: Path
) -> None:
    settings = settings_for(kafka_broker)
    producer = TelemetryProducer(settings, tmp_path / "spool")
    # Before any consumer asks for metadata: Tansu auto-creates unknown topics (4 partitions).
    ensure_topics(kafka_broker.bootstrap, topic_specs(settings))
    before = open_consumer(kafka_broker, settings.topic)
    traffic = Traffic(producer)
    traffic.resume()
    traffic.wait_for(150)

    # Memory storage forgets whatever the consumer has not fetched when the broker dies, so
    # pull the plug at an acknowledged frontier: pause, flush, drain, kill, resume at once.
    traffic.pause()
    assert producer.flush(10)
    num_at_stop = len(traffic.sent)
    consumed_before = received(poll_until(before, num_at_stop))
    before.close()
    kafka_broker.stop()
    traffic.resume()
    detection_s = wait_until(lambda: producer.stats().spooled > 0, 15, "records to spool")
    traffic.wait_for(num_at_stop + 300)
    during = producer.stats()
    assert during.spooled > 0 and during.spool_bytes > 0 and not during.connected

    kafka_broker.start()  # empty: the producer recreates the topics when it reconnects
    drained_s = wait_until(lambda: producer.stats().spool_bytes == 0, 30, "the spool to drain")
    traffic.wait_for(len(traffic.sent) + 100)  # newer events go straight out again
    traffic.stop()
    assert producer.flush(10)
    num_after = len(traffic.sent) - len(consumed_before)
    consumed_after = received(consume(kafka_broker, settings.topic, num_after))
    producer.close()

    log.info("outage noticed in %.2fs; spool drained %.2fs after restart", detection_s, drained_s)
    assert ids_by_key(consumed_before) == ids_by_key(traffic.sent[:num_at_stop])
    assert ids_by_key(consumed_before + consumed_after) == ids_by_key(traffic.sent)
    after = producer.stats()
    assert after.replayed == after.spooled and after.spool_bytes == 0 and after.dropped == 0
    assert after.sent + after.replayed == len(traffic.sent) and after.sent > num_at_stop


def test_new_producer_replays_a_leftover_spool(kafka_broker: Broker, tmp_path: Path) -> None:
    settings = settings_for(kafka_broker)
    kafka_broker.stop()
    first = TelemetryProducer(settings, tmp_path / "spool")
    old = [make_event(4 * i, "old") for i in range(50)]  # one model|level key: total order
    for event in old:
        first.send(event)
    wait_until(lambda: first.stats().spooled == len(old), 10, "the first producer to spool")
    first.close()
    assert list((tmp_path / "spool").glob("segment-*.jsonl"))

    kafka_broker.start()
    second = TelemetryProducer(settings, tmp_path / "spool")
    new = make_event(0, "new")
    second.send(new)
    assert second.flush(15)
    records = consume(kafka_broker, settings.topic, len(old) + 1)
    stats = second.stats()
    second.close()

    assert [trace_id for _, trace_id in received(records)] == [e.trace_id for e in old] + [
        "new-00000"
    ]
    assert stats.replayed >= len(old) and stats.replayed + stats.sent == len(old) + 1
    assert not list((tmp_path / "spool").glob("segment-*.jsonl"))


def test_full_spool_drops_the_oldest_segment(kafka_broker: Broker, tmp_path: Path) -> None:
    settings = settings_for(kafka_broker, spool_max_bytes=16 * 1024)
    kafka_broker.stop()
    producer = TelemetryProducer(settings, tmp_path / "spool")
    events = [make_event(4 * i, "bound") for i in range(60)]
    for event in events:
        producer.send(event)
    wait_until(lambda: producer.stats().spooled == len(events), 10, "events to spool")
    full = producer.stats()
    assert full.dropped > 0 and full.spooled == len(events)
    assert 0 < full.spool_bytes <= settings.spool_max_bytes

    kafka_broker.start()
    assert producer.flush(15)
    survivors = len(events) - full.dropped
    records = consume(kafka_broker, settings.topic, survivors)
    producer.close()
    assert [trace_id for _, trace_id in received(records)] == [
        e.trace_id for e in events[-survivors:]
    ]


def test_torn_spool_line_is_skipped(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=1 << 20)
    spool.append([OutgoingRecord("sparseguard.telemetry", b"k", b'{"a": 1}', [("ce_id", b"x")])])
    spool.close()
    with next(tmp_path.glob("segment-*.jsonl")).open("ab") as file:
        file.write(b'{"topic": "sparseguard.tel')  # a crash mid-write
    reopened = Spool(tmp_path, max_bytes=1 << 20)
    try:
        segment = reopened.oldest()
        assert segment is not None and reopened.num_records == 2
        records, num_bad = reopened.read(segment)
    finally:
        reopened.close()
    assert [r.value for r in records] == [b'{"a": 1}'] and num_bad == 1


def test_spool_directory_has_one_owner(tmp_path: Path) -> None:
    owner = Spool(tmp_path, max_bytes=1 << 20)
    with pytest.raises(SpoolLockedError, match="its own telemetry spool_dir"):
        Spool(tmp_path, max_bytes=1 << 20)
    owner.close()
    Spool(tmp_path, max_bytes=1 << 20).close()
