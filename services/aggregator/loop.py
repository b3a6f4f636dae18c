"""The aggregator loop: poll a batch, dead-letter what is malformed, persist the rest (a
replayed trace id is skipped), fold only what was new, then commit the offsets. A crash
between persisting and committing replays the batch, and the replay changes nothing.

Windows stay exact with several aggregators because events are keyed by (model, level): one
key always lands on one partition, and a partition belongs to one group member. When
partitions move, the new owner rebuilds those keys' windows from the stored summaries."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

from kafka import ConsumerRebalanceListener, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import KafkaError
from sqlalchemy.orm import Session, sessionmaker

from alerts.samples import pipeline_sample
from services.aggregator import windows
from services.aggregator.alert_loop import AlertLoop
from services.aggregator.job_figures import job_samples
from services.aggregator.metrics import AggregatorMetrics
from services.aggregator.records import KafkaRecord, dead_letter_headers, parse_records, summary_row
from services.aggregator.summary import WindowSummary
from services.config import Settings
from services.storage.repository import (
    calibration_baselines,
    calibration_targets,
    insert_summaries,
    save_snapshots,
    summaries_since,
)
from services.telemetry.schema import TelemetryEvent
from services.telemetry.topics import ensure_topics, topic_specs

log = logging.getLogger(__name__)
Hook = Callable[[], None]
LAG_INTERVAL_S = 5.0
EXEMPLARS = 5  # trace ids kept per (model, level) for alerts to name


class Aggregator:
    def __init__(
        self,
        settings: Settings,
        sessions: sessionmaker[Session],
        metrics: AggregatorMetrics,
        after_persist: Hook | None = None,
        alerting: AlertLoop | None = None,
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self.metrics = metrics
        self.after_persist = after_persist  # tests use it to crash between persist and commit
        self.state = windows.new_state(
            windows.FoldConfig(
                lateness_s=settings.aggregator.lateness_s,
                gate_band=settings.signals.gate_band,
                late_band=settings.signals.late_band,
            )
        )
        self.lock = threading.Lock()  # the HTTP thread reads the state
        self.key_partitions: dict[tuple[str, str], int] = {}
        self.owned: set[int] = set()
        self.targets: dict[str, float] = {}
        self.baselines: dict[str, dict[str, Any] | None] = {}
        self.folded = 0
        # event time -> fold time of recent events, for the pipeline benchmark and /windows
        self.recent_latency_s: deque[float] = deque(maxlen=10_000)
        # The latest requests' trace ids per (model, level): what an alert names.
        self.exemplars: dict[tuple[str, str], deque[str]] = {}
        self._last_snapshot = time.monotonic()
        self.alerting = alerting  # evaluates the windows this member owns
        self._last_evaluation = 0.0
        self.lag_total: float | None = None

    def run(self, stop: threading.Event, ready: threading.Event | None = None) -> None:
        consumer = self._consumer()
        dead_letters = KafkaProducer(bootstrap_servers=self.settings.telemetry.bootstrap_servers)
        last_lag = 0.0
        try:
            while not stop.is_set():
                batch = consumer.poll(timeout_ms=self.settings.aggregator.poll_timeout_ms)
                if ready is not None and consumer.assignment():
                    ready.set()
                records = [r for part in batch.values() for r in part]
                if records:
                    self.handle(records, dead_letters)
                    consumer.commit()
                self._periodic()
                if time.monotonic() - last_lag > LAG_INTERVAL_S:
                    self._report_lag(consumer)
                    self._ensure_topics()
                    last_lag = time.monotonic()
        finally:
            consumer.close(autocommit=False)
            dead_letters.close(timeout=5)

    def handle(self, records: list[KafkaRecord], dead_letters: Any) -> int:
        """Persist, fold and dead-letter one batch; returns the number of new events."""
        started = time.perf_counter()
        parsed, rejected = parse_records(records)
        for bad in rejected:
            topic = self.settings.telemetry.dead_letter_topic
            dead_letters.send(
                topic, value=bad.record.value, key=bad.record.key, headers=dead_letter_headers(bad)
            )
            self.metrics.counter("events_dead_lettered_total").inc()
            log.warning(
                "dead-lettered %s/%s: %s", bad.record.partition, bad.record.offset, bad.reason
            )
        if rejected:
            dead_letters.flush(timeout=10)
        with self.sessions.begin() as session:
            new_ids = (
                insert_summaries(session, [summary_row(p) for p in parsed]) if parsed else set()
            )
        if self.after_persist is not None:
            self.after_persist()
        fresh = [p for p in parsed if p.event.trace_id in new_ids]
        self.metrics.counter("events_duplicate_total").inc(len(parsed) - len(fresh))
        for p in fresh:
            self.key_partitions[(p.event.model, p.event.level)] = p.partition
        self._fold([p.event for p in fresh])
        self.metrics.histogram("aggregator_batch_seconds").observe(time.perf_counter() - started)
        return len(fresh)

    def persist_snapshots(self) -> int:
        """Store the owned keys' current windows (history for dashboards and alerts), and
        pick up calibration targets registered since."""
        self._last_snapshot = time.monotonic()
        with self.sessions() as session:
            self._read_calibrations(session)
        rows = [
            {
                "model": model,
                "level": level,
                "window": name,
                "window_end": summary.end,
                "data": summary.to_dict(),
            }
            for (model, level), by_window in self.snapshot().items()
            for name, summary in by_window.items()
        ]
        if rows:
            with self.sessions.begin() as session:
                save_snapshots(session, rows)
        return len(rows)

    def _periodic(self) -> None:
        now = time.monotonic()
        if now - self._last_snapshot > self.settings.aggregator.snapshot_interval_s:
            self.persist_snapshots()
        if now - self._last_evaluation > self.settings.alerts.evaluation_interval_s:
            self.evaluate_alerts()

    def evaluate_alerts(self) -> int:
        """Run the alert rules over the owned windows and the pipeline figures."""
        self._last_evaluation = time.monotonic()
        if self.alerting is None:
            return 0
        pipeline = [pipeline_sample("consumer_lag_events", self.lag_total, component="aggregator")]
        with self.sessions() as session:
            pipeline += job_samples(session, datetime.now(UTC), self.metrics)
        with self.lock:
            exemplars = {key: list(ids) for key, ids in self.exemplars.items()}
        return len(self.alerting.tick(self.snapshot(), pipeline, exemplars=exemplars))

    def snapshot(self) -> dict[tuple[str, str], dict[str, WindowSummary]]:
        with self.lock:
            return windows.snapshot(
                self.state, datetime.now(UTC), self.targets, self.baselines, self.settings.signals
            )

    def _read_calibrations(self, session: Session) -> None:
        """Targets, and the baselines of versions registered since the last read."""
        self.targets = calibration_targets(session)
        # A version without a baseline is read again: the baseline job adds one later.
        known = {version for version, found in self.baselines.items() if found is not None}
        self.baselines.update(calibration_baselines(session, known))

    def rebuild(self, partitions: set[int]) -> None:
        """Own exactly `partitions`: forget other keys, reload these from stored summaries."""
        since = datetime.now(UTC) - timedelta(seconds=max(windows.WINDOWS.values()))
        with self.sessions() as session:
            rows = summaries_since(session, since, partitions)
            self._read_calibrations(session)
        events = [TelemetryEvent.model_validate(row.event) for row in rows]
        with self.lock:
            self.owned = set(partitions)
            self.state = windows.new_state(self.state.config)
            self.key_partitions = {
                (r.model, r.level): r.partition for r in rows if r.partition is not None
            }
            windows.apply(self.state, events)
        log.info(
            "own partitions %s: rebuilt %d keys from %d stored events",
            sorted(partitions),
            len(self.key_partitions),
            len(events),
        )

    def _fold(self, events: Iterable[TelemetryEvent]) -> None:
        events = list(events)
        with self.lock:
            late_before = self.state.late_dropped
            windows.apply(self.state, events)
            late = self.state.late_dropped - late_before
            for event in events:
                key = (event.model, event.level)
                self.exemplars.setdefault(key, deque(maxlen=EXEMPLARS)).append(event.trace_id)
        self.metrics.counter("events_late_total").inc(late)
        now = datetime.now(UTC)
        self.metrics.observe(events, now)
        self.recent_latency_s.extend((now - e.time).total_seconds() for e in events)
        self.folded += len(events)

    def _consumer(self) -> KafkaConsumer:
        cfg, agg = self.settings.telemetry, self.settings.aggregator
        consumer = KafkaConsumer(
            bootstrap_servers=cfg.bootstrap_servers,
            group_id=agg.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_poll_records=agg.max_poll_records,
            session_timeout_ms=agg.session_timeout_ms,
            heartbeat_interval_ms=agg.heartbeat_interval_ms,
        )
        consumer.subscribe([cfg.topic], listener=_Rebalance(self))
        return consumer

    def _ensure_topics(self) -> None:
        """Create the topics again if they are gone: a restarted broker with memory storage
        comes back without them, and the consumer would wait for a topic nobody creates
        until the next event is produced."""
        cfg = self.settings.telemetry
        try:
            ensure_topics(cfg.bootstrap_servers, topic_specs(cfg))
        except (KafkaError, OSError) as exc:
            log.debug("topics not checked (%s)", exc)

    def _report_lag(self, consumer: KafkaConsumer) -> None:
        assigned = consumer.assignment()
        if not assigned:
            return
        ends = consumer.end_offsets(list(assigned))
        total = 0
        for tp in assigned:
            lag = ends[tp] - consumer.position(tp)
            total += lag
            self.metrics.gauge("aggregator_consumer_lag_events").labels(str(tp.partition)).set(lag)
        self.lag_total = float(total)


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, aggregator: Aggregator) -> None:
        self.aggregator = aggregator

    def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        log.info("partitions revoked: %s", sorted(tp.partition for tp in revoked))

    def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        self.aggregator.rebuild({tp.partition for tp in assigned})
