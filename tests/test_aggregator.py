"""The aggregator against the real Kafka-compatible broker (Tansu) and SQLite: two group
members split the partitions and hand over, a crash between persist and commit changes no
count, malformed events go to the dead-letter topic."""

from __future__ import annotations

from pathlib import Path

import httpx
from kafka import KafkaConsumer

from services.aggregator.http import create_http_app
from services.shared.serving import serve
from services.storage.db import make_engine, session_factory
from services.storage.repository import upsert_calibration
from services.telemetry.broker import Broker
from tests.aggregator_fixtures import (
    KEYS,
    event,
    key_partition,
    new_aggregator,
    pipeline_settings,
    produce,
    running,
    stored,
    window_requests,
)
from tests.polling import wait_until


def test_two_members_split_partitions_and_hand_over(kafka_broker: Broker, tmp_path: Path) -> None:
    settings = pipeline_settings(tmp_path, kafka_broker.bootstrap)
    first = [event(m, lv) for m, lv in KEYS for _ in range(10)]
    a, b = new_aggregator(settings), new_aggregator(settings)
    with running(b):
        with running(a):
            wait_until(lambda: len(a.owned) + len(b.owned) == 4 and bool(a.owned) and bool(b.owned))
            produce(settings, first, key_partition)
            wait_until(lambda: a.folded + b.folded == 40)
            assert a.folded > 0 and b.folded > 0
            assert window_requests(a) + window_requests(b) == 40
        # a has left the group: b owns every partition and rebuilt their windows from SQL
        wait_until(lambda: b.owned == {0, 1, 2, 3})
        produce(settings, [event(m, lv) for m, lv in KEYS for _ in range(5)], key_partition)
        wait_until(lambda: window_requests(b) == 60)
        assert b.persist_snapshots() == 4 * 3  # every key, every window
    assert stored(settings) == 60


def test_crash_between_persist_and_commit_keeps_counts_exact(
    kafka_broker: Broker, tmp_path: Path
) -> None:
    settings = pipeline_settings(tmp_path, kafka_broker.bootstrap, partitions=1)
    produce(settings, [event("m1", "balanced") for _ in range(30)])

    def crash() -> None:
        raise RuntimeError("simulated crash after persisting, before committing offsets")

    crashing = new_aggregator(settings, after_persist=crash)
    with running(crashing) as thread:
        wait_until(lambda: not thread.is_alive())
    persisted = stored(settings)
    assert persisted > 0  # the first batch was stored, its offsets never committed
    survivor = new_aggregator(settings)

    def duplicates() -> float:
        value = survivor.metrics.registry.get_sample_value("sparseguard_events_duplicate_total")
        return value or 0.0

    with running(survivor):
        # the replayed batch is recognised (not counted twice) and the rest is folded
        wait_until(lambda: duplicates() == persisted and stored(settings) == 30)
        wait_until(lambda: window_requests(survivor) == 30)
        assert survivor.folded == 30 - persisted
    assert window_requests(survivor) == 30


def test_malformed_events_are_dead_lettered_and_windows_served(
    kafka_broker: Broker, tmp_path: Path
) -> None:
    settings = pipeline_settings(tmp_path, kafka_broker.bootstrap, partitions=1)
    good = event("m1", "balanced", sparsity_ratio=0.4, trust_action="flag")
    produce(settings, [good])
    from kafka import KafkaProducer

    raw = KafkaProducer(bootstrap_servers=kafka_broker.bootstrap)
    raw.send(settings.telemetry.topic, value=b"{not json")
    raw.send(
        settings.telemetry.topic,
        value=good.model_copy(update={"schema_version": "2.0", "trace_id": "x2"})
        .model_dump_json()
        .encode(),
    )
    raw.flush(10)
    raw.close()
    with session_factory(make_engine(settings.database_url)).begin() as session:
        upsert_calibration(
            session,
            {
                "version": "m1-balanced-v1",
                "model_id": "m1",
                "level": "balanced",
                "weights_sha256": "x",
                "target_sparsity": 0.45,
                "realised_sparsity": 0.44,
                "perplexity_change_pct": 1.5,
                "reason": "cli",
                "artefact": {},
            },
        )
    aggregator = new_aggregator(settings)
    with running(aggregator):
        wait_until(
            lambda: (
                aggregator.metrics.registry.get_sample_value(
                    "sparseguard_events_dead_lettered_total"
                )
                == 2
            )
        )
        with serve(create_http_app(aggregator)) as url:
            windows = httpx.get(f"{url}/windows").json()
            metrics = httpx.get(f"{url}/metrics").text
    dlq = KafkaConsumer(
        settings.telemetry.dead_letter_topic,
        bootstrap_servers=kafka_broker.bootstrap,
        auto_offset_reset="earliest",
        consumer_timeout_ms=5000,
    )
    reasons = [dict(r.headers)["dlq_reason"].decode() for r in dlq]
    dlq.close()
    assert (
        len(reasons) == 2
        and any("JSON" in r or "json" in r for r in reasons)
        and any("2.0" in r for r in reasons)
    )
    five = windows["keys"][0]["windows"]["5m"]
    assert five["requests"] == 1 and abs(five["sparsity_mean"] - 0.4) < 1e-9
    assert five["sparsity_target"] == 0.45  # from the calibration registered in SQL
    assert (
        'sparseguard_window_sparsity_ratio{level="balanced",model="m1",window="5m"} 0.4' in metrics
    )
    assert (
        'sparseguard_trust_actions_total{action="flag",level="balanced",model="m1"} 1.0' in metrics
    )
