"""ControlListener: a daemon thread that follows the control topic and installs what is
published for this gateway's model without a restart: each new calibration for its weights
(requests already admitted keep the plan they were pinned to), and each new trust model for its
model id (handed to `on_trust_model`, which swaps the judge for requests that start afterwards).
Both are kept in the local stores, so a restarted gateway starts on them."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from contextlib import closing
from typing import Any

from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition
from prometheus_client import Counter

from services.config import Settings
from services.telemetry.control import CalibrationPublished, decode
from services.telemetry.delivery import is_reachable, servers
from services.telemetry.topics import ensure_topics, topic_specs
from sparse_engine.calibration.store import Calibration, CalibrationNotFoundError, CalibrationStore
from sparse_engine.jsonstore import JsonStore
from sparse_engine.runtime.engine import Engine
from sparse_engine.trust.model import TrustModel, TrustModelNotFoundError, TrustStore

log = logging.getLogger(__name__)

POLL_MS = 500
CHECK_INTERVAL_S = 5.0
BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 30.0
# Short timeouts so a dead broker is noticed in seconds (kafka-python waits 30 s by default).
TIMEOUTS: dict[str, Any] = {
    "request_timeout_ms": 5_000,
    "bootstrap_timeout_ms": 5_000,
    "reconnect_backoff_max_ms": 1_000,
}
# The version names the artefact's file in the store: nothing that could leave its directory.
SAFE_VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
TrustModelHandler = Callable[[TrustModel, str], None]  # (model, reason)


class ControlListener:
    """Reads partition 0 of the control topic without a consumer group, from the end: only
    artefacts published while the gateway runs matter (older ones are in the local stores).
    `ready` is set once the listener is positioned; a broker outage is retried with backoff."""

    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        reloads: Counter,
        on_trust_model: TrustModelHandler | None = None,
    ) -> None:
        self._telemetry = settings.telemetry
        self._store = CalibrationStore(settings.calibrations_dir)
        self._trust_dir = settings.trust_dir
        self._engine = engine
        self._reloads = reloads
        self._on_trust_model = on_trust_model
        self._partition = TopicPartition(settings.telemetry.control_topic, 0)
        self._next_offset: int | None = None
        self._seen_topic_id: str | None = None
        self._backoff_s = BACKOFF_MIN_S
        self._is_down = False
        self._stopping = threading.Event()
        self.ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="control-listener", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("control listener still busy after %.1fs", timeout)

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._listen()
            except Exception as exc:  # the thread outlives any broker trouble: retry later
                self.ready.clear()
                if not self._is_down:
                    log.warning("control topic unavailable (%s); retrying until it is back", exc)
                    self._is_down = True
                self._stopping.wait(self._backoff_s)
                self._backoff_s = min(2 * self._backoff_s, BACKOFF_MAX_S)

    def _listen(self) -> None:
        bootstrap = self._telemetry.bootstrap_servers
        if not is_reachable(bootstrap):
            raise ConnectionError(f"no bootstrap server accepts connections at {bootstrap}")
        specs = [s for s in topic_specs(self._telemetry) if s.name == self._partition.topic]
        ensure_topics(bootstrap, specs)
        with closing(KafkaAdminClient(bootstrap_servers=servers(bootstrap), **TIMEOUTS)) as admin:
            consumer = KafkaConsumer(
                bootstrap_servers=servers(bootstrap),
                client_id=f"{self._telemetry.client_id}-control",
                group_id=None,
                enable_auto_commit=False,
                # Only used when our offset is past the end: the log was lost, so all of it
                # is new to us.
                auto_offset_reset="earliest",
                **TIMEOUTS,
            )
            try:
                self._follow(admin, consumer)
            finally:
                consumer.close(autocommit=False)

    def _follow(self, admin: KafkaAdminClient, consumer: KafkaConsumer) -> None:
        consumer.assign([self._partition])
        topic_id = self._topic_id(admin)
        self._seek(consumer, recreated=topic_id != self._seen_topic_id)
        self._seen_topic_id = topic_id
        self._connected()
        checked_at = time.monotonic()
        while not self._stopping.is_set():
            for records in consumer.poll(timeout_ms=POLL_MS).values():
                for record in records:
                    self._next_offset = record.offset + 1
                    self._handle(record.value, record.offset)
            if time.monotonic() - checked_at > CHECK_INTERVAL_S:
                # A broker on memory storage comes back from a restart without the topic, or
                # with a new one under the same name, where our offset means nothing.
                if self._topic_id(admin) != topic_id:
                    raise RuntimeError(f"topic {self._partition.topic} was recreated")
                checked_at = time.monotonic()

    def _topic_id(self, admin: KafkaAdminClient) -> str | None:
        described = admin.describe_topics([self._partition.topic])
        found = described[0] if described and not described[0].get("error_code") else {}
        topic_id = found.get("topic_id")
        return str(topic_id) if topic_id else None

    def _seek(self, consumer: KafkaConsumer, recreated: bool) -> None:
        """The end on first start; after an interruption, where we stopped, so nothing
        published meanwhile is missed, or the beginning of a topic that was recreated."""
        end = consumer.end_offsets([self._partition])[self._partition]
        if self._next_offset is None:
            self._next_offset = end
        elif recreated or self._next_offset > end:
            self._next_offset = consumer.beginning_offsets([self._partition])[self._partition]
        consumer.seek(self._partition, self._next_offset)

    def _connected(self) -> None:
        if self._is_down:
            log.info("control topic reachable again")
        self._is_down = False
        self._backoff_s = BACKOFF_MIN_S
        self.ready.set()

    def _handle(self, value: bytes | None, offset: int) -> None:
        try:
            message = decode(value or b"")
            if isinstance(message, CalibrationPublished):
                self._apply(message.calibration, message.reason)
            elif message is not None:
                self._apply_trust(message.model, message.reason)
        except Exception as exc:  # one bad message must not stop the ones after it
            log.warning("skipped control message at offset %d: %s", offset, exc)

    def _apply(self, cal: Calibration, reason: str) -> None:
        if cal.weights_sha256 != self._engine.lm.weights_sha256:
            return  # another model's calibration
        if not SAFE_VERSION.fullmatch(cal.version):
            raise ValueError(f"calibration version {cal.version!r} is not a safe file name")
        plan = cal.plan()
        old = self._engine.plans.get(plan.level)
        old_version = old.calibration_version if old is not None else None
        if old_version == cal.version:
            self._keep(cal)  # the same plan, perhaps with the baseline measured since
            return
        self._engine.install(plan)
        self._reloads.labels(plan.level.value).inc()
        log.info(
            "calibration of %s at %s: %s -> %s (%s)",
            self._engine.lm.model_id,
            plan.level.value,
            old_version,
            cal.version,
            reason or "no reason given",
        )
        self._keep(cal)

    def _keep(self, cal: Calibration) -> None:
        """Save the artefact (so a restarted gateway starts on it, and the trust reasons read
        its baseline), unless the store has it with a baseline already. A store that cannot
        be written costs only that: the version is served all the same."""
        try:
            if self._store.load(cal.version).baseline is not None or cal.baseline is None:
                return
        except CalibrationNotFoundError:
            pass
        try:
            self._store.save(cal)
        except OSError:
            log.exception("could not save calibration %s locally", cal.version)

    def _apply_trust(self, model: TrustModel, reason: str) -> None:
        if model.model_id != self._engine.lm.model_id or self._on_trust_model is None:
            return  # another model's, or nobody here scores trust
        if not SAFE_VERSION.fullmatch(model.version):
            raise ValueError(f"trust model version {model.version!r} is not a safe file name")
        self._keep_trust(model)  # first: a restart, and the judge rebuilt from the store, see it
        self._on_trust_model(model, reason)

    def _keep_trust(self, model: TrustModel) -> None:
        """Save the trust model under its published version (the store is only the gateway's
        memory across restarts: an unwritable one costs nothing else)."""
        try:
            TrustStore(self._trust_dir).load(model.version)
        except TrustModelNotFoundError:
            try:
                JsonStore(self._trust_dir).save(model.version, model.to_dict())
            except OSError:
                log.exception("could not save trust model %s locally", model.version)
