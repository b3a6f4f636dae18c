"""TelemetryProducer: `send()` only enqueues; one background thread delivers to Kafka, writes
to the disk spool while the broker is unreachable, and replays the spool, oldest first, before
any newer record goes out directly."""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kafka.errors import KafkaError

from services.config import TelemetrySettings
from services.telemetry.delivery import close_quietly, deliver, is_reachable, open_producer
from services.telemetry.schema import TelemetryEvent, to_record
from services.telemetry.spool import OutgoingRecord, Spool
from services.telemetry.topics import ensure_topics, topic_specs

log = logging.getLogger(__name__)

MAX_QUEUE_RECORDS = 50_000  # ~75 MB at worst; fills only if the thread stalls
MAX_RECORD_BYTES = 512 * 1024  # far above any real event; keeps one record from poisoning replay
WINDOW_RECORDS = 1_000
IDLE_POLL_S = 0.1
BACKOFF_MIN_S = 0.25
BACKOFF_MAX_S = 2.0


@dataclass(slots=True)
class ProducerStats:
    sent: int = 0  # acknowledged without going through the spool
    spooled: int = 0  # written to the spool
    replayed: int = 0  # acknowledged from the spool
    dropped: int = 0  # lost: spool or queue full, oversized, spool unwritable, sent after close
    errors: int = 0  # failed deliveries and failed connection attempts
    spool_bytes: int = 0
    queue_depth: int = 0
    connected: bool = False


class TelemetryProducer:
    """Thread-safe `send`; `create_topics` makes each (re)connect ensure the topics exist (a
    memory-backed embedded broker comes back empty after a restart)."""

    def __init__(
        self, settings: TelemetrySettings, spool_dir: Path, *, create_topics: bool = True
    ) -> None:
        self._settings = settings
        self._create_topics = create_topics
        self._spool = Spool(spool_dir, settings.spool_max_bytes)
        self._queue: queue.Queue[OutgoingRecord] = queue.Queue(MAX_QUEUE_RECORDS)
        self._cond = threading.Condition()
        self._stats = ProducerStats(spool_bytes=self._spool.num_bytes)
        self._pending = self._spool.num_records  # accepted, not yet acknowledged nor dropped
        self._closing = threading.Event()
        self._kafka: Any = None
        self._backoff_s = BACKOFF_MIN_S
        self._next_attempt = 0.0
        if self._pending:
            log.info("telemetry spool %s holds %d records to replay", spool_dir, self._pending)
        self._thread = threading.Thread(target=self._run, name="telemetry-producer", daemon=True)
        self._thread.start()

    # -- caller side --------------------------------------------------------------------------

    def send(self, event: TelemetryEvent) -> None:
        """Enqueue one event; never blocks on the broker and never raises for broker trouble."""
        record = OutgoingRecord(self._settings.topic, *to_record(event))
        with self._cond:
            if self._closing.is_set() or len(record.value) > MAX_RECORD_BYTES:
                self._stats.dropped += 1
                log.warning("telemetry event %s dropped (closed or oversized)", event.trace_id)
                return
            try:
                self._queue.put_nowait(record)
            except queue.Full:
                self._stats.dropped += 1
                log.warning("telemetry queue full; event %s dropped", event.trace_id)
                return
            self._pending += 1

    def stats(self) -> ProducerStats:
        with self._cond:
            return dataclasses.replace(self._stats, queue_depth=self._queue.qsize())

    def flush(self, timeout: float) -> bool:
        """Wait until every accepted record (spooled ones included) is acknowledged or dropped."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting, deliver or spool what is queued, stop the thread. Spooled records
        stay on disk for the next producer on the same directory; call flush() first to wait
        for them to be delivered."""
        with self._cond:
            self._closing.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("telemetry producer thread still busy after %.1fs", timeout)

    # -- bookkeeping --------------------------------------------------------------------------

    def _count(self, *, settled: int = 0, **deltas: int) -> None:
        with self._cond:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)
            self._stats.spool_bytes = self._spool.num_bytes
            self._pending -= settled
            if settled:
                self._cond.notify_all()

    def _set_connected(self, connected: bool) -> None:
        with self._cond:
            self._stats.connected = connected

    # -- producer thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while not (self._closing.is_set() and self._queue.empty()):
            try:
                self._step()
            except Exception as exc:  # the thread must outlive any surprise: log and retry later
                log.exception("telemetry producer step failed")
                self._disconnect()
                self._retry_later(exc)
        self._disconnect()
        self._spool.close()

    def _step(self) -> None:
        batch = self._take(WINDOW_RECORDS)
        if not self._closing.is_set():
            self._maintain()  # first, so the first events go straight out once connected
        if batch:
            self._dispatch(batch)

    def _take(self, max_records: int) -> list[OutgoingRecord]:
        busy = self._kafka is not None and not self._spool.is_empty
        try:
            batch = [self._queue.get(timeout=0 if busy else IDLE_POLL_S)]
        except queue.Empty:
            return []
        while len(batch) < max_records:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return batch

    def _dispatch(self, batch: list[OutgoingRecord]) -> None:
        # Straight to Kafka only when nothing older waits in the spool: that keeps the order.
        if self._kafka is not None and self._spool.is_empty:
            num_acked = deliver(self._kafka, batch)
            self._count(sent=num_acked, settled=num_acked)
            if num_acked == len(batch):
                return
            self._on_failure(f"{len(batch) - num_acked} of {len(batch)} records unacknowledged")
            batch = batch[num_acked:]
        self._to_spool(batch)

    def _to_spool(self, records: list[OutgoingRecord]) -> None:
        try:
            num_dropped = self._spool.append(records)
        except OSError:
            log.exception("telemetry spool write failed; %d records lost", len(records))
            self._count(dropped=len(records), settled=len(records))
            return
        self._count(spooled=len(records), dropped=num_dropped, settled=num_dropped)

    def _maintain(self) -> None:
        if self._kafka is None:
            if time.monotonic() >= self._next_attempt:
                self._connect()
        elif not self._spool.is_empty:
            self._replay_oldest()

    def _replay_oldest(self) -> None:
        segment = self._spool.oldest()
        if segment is None:
            return
        try:
            records, num_bad = self._spool.read(segment)
        except OSError:
            log.exception("telemetry spool segment %s unreadable; dropped", segment.path.name)
            lost = segment.num_records - segment.num_acked
            self._spool.remove(segment)
            self._count(dropped=lost, settled=lost)
            return
        self._count(dropped=num_bad, settled=num_bad)
        todo = records[segment.num_acked :]
        num_acked = deliver(self._kafka, todo)
        segment.num_acked += num_acked
        if num_acked == len(todo):
            self._spool.remove(segment)
        self._count(replayed=num_acked, settled=num_acked)
        if num_acked < len(todo):
            self._on_failure(f"replay of {segment.path.name} stopped at {segment.num_acked}")

    def _connect(self) -> None:
        servers = self._settings.bootstrap_servers
        try:
            if not is_reachable(servers):
                raise ConnectionError(f"no bootstrap server accepts connections at {servers}")
            if self._create_topics:
                ensure_topics(servers, topic_specs(self._settings))
            self._kafka = open_producer(self._settings)
        except (KafkaError, OSError) as exc:
            self._retry_later(exc)
            return
        self._backoff_s = BACKOFF_MIN_S
        self._set_connected(True)
        log.info("telemetry connected to %s (%d to replay)", servers, self._spool.num_records)

    def _on_failure(self, reason: str) -> None:
        log.warning("telemetry delivery failed (%s); spooling until the broker is back", reason)
        self._disconnect()
        self._count(errors=1)
        self._next_attempt = time.monotonic() + self._backoff_s

    def _retry_later(self, exc: BaseException) -> None:
        level = logging.WARNING if self._backoff_s == BACKOFF_MIN_S else logging.DEBUG
        log.log(level, "telemetry broker unavailable (%s); retry in %.2fs", exc, self._backoff_s)
        self._count(errors=1)
        self._next_attempt = time.monotonic() + self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, BACKOFF_MAX_S)

    def _disconnect(self) -> None:
        if self._kafka is not None:
            close_quietly(self._kafka)
        self._kafka = None
        self._set_connected(False)
