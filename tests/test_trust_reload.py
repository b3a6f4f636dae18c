"""Trust models without a restart: the control codec's trust-model message (calibration messages
read as before), the judge rebuilt with the models that arrived, a gateway on a real broker
that scores by the rule until a published trust model arrives and then by the model, and the
`trust_fit` job's plain function (a model per level, fit once, published, skipped when one
exists), which `up` queues when the served model has no trust model."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import httpx
import pytest
from kafka import KafkaConsumer, TopicPartition

from services.cli.up import queue_trust_fit
from services.config import (
    EngineSettings,
    GatewaySettings,
    Settings,
    TelemetrySettings,
    TrustSettings,
)
from services.gateway.app import create_app
from services.gateway.trust import load_judge, reload_judge, serving_versions
from services.shared.serving import serve
from services.storage.db import make_engine, session_factory, upgrade
from services.storage.models import JobRun
from services.telemetry.broker import Broker
from services.telemetry.control import (
    CALIBRATION_PUBLISHED,
    TRUST_MODEL_PUBLISHED,
    CalibrationPublished,
    TrustModelPublished,
    decode,
    encode,
    encode_trust_model,
    publish_trust_model,
)
from services.workers.jobs import ClaimedJob
from services.workers.trust_fit import FitSpec, answers, fit_trust
from sparse_engine.runtime.engine import Engine
from sparse_engine.sparsity.plan import Level
from sparse_engine.trust.evaluate import answer_all
from sparse_engine.trust.features import RequestSignals
from sparse_engine.trust.model import TrustModel, TrustStore, fit
from sparse_engine.trust.qa import QAItem, load_qa, normalise_answer, qa_sample
from tests.gateway_fixtures import RecordingSink
from tests.polling import wait_until
from tests.test_hot_reload import _send_raw, _task_in_broker
from tests.test_trust_unit import _stats
from tests.tiny import calibration_of, tiny_engine

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def trust_model(
    model_id: str, bias: float, created_at: str, level: str = "balanced", mode: str = "serve"
) -> TrustModel:
    """A fitted model whose score is about sigmoid(`bias`) for any answer."""
    rng = random.Random(0)
    sigs = [RequestSignals(mean_logprob=rng.gauss(0, 1)) for _ in range(40)]
    model = fit(sigs, [s.mean_logprob > 0 for s in sigs], model_id=model_id, level=level,
                fit_data={"data": "test"}, l2=0.01, mode=mode)  # fmt: skip
    model.weights = [0.0] * len(model.weights)
    model.bias = bias
    model.created_at = created_at
    return model


def published(root: Path, model: TrustModel) -> TrustModel:
    """`model` saved (and so versioned) in another host's store, as a worker publishes it."""
    return TrustStore(root).save(model)


def test_codec_carries_whole_trust_models_and_reads_calibrations_as_before(
    tmp_path: Path,
) -> None:
    model = published(tmp_path, trust_model("tiny-llama", -3.0, "2025-01-02T03:04:05+00:00"))
    key, value, headers = encode_trust_model(model, "first-serve")
    message = decode(value)
    assert isinstance(message, TrustModelPublished) and message.reason == "first-serve"
    assert message.model.to_dict() == model.to_dict()
    assert key == b"tiny-llama|trust|balanced"
    assert dict(headers)["ce_type"] == TRUST_MODEL_PUBLISHED.encode()
    assert dict(headers)["ce_id"] == model.version.encode()
    # A calibration message as every earlier version wrote it still reads as one.
    cal = calibration_of(tiny_engine(cache=False), "tiny-balanced-v2")
    old = {"type": CALIBRATION_PUBLISHED, "reason": "drift", "calibration": cal.to_dict()}
    read = decode(json.dumps(old).encode())
    assert isinstance(read, CalibrationPublished) and read.calibration == cal
    assert decode(encode(cal, "drift")[1]) == read
    assert decode(json.dumps({"type": "io.sparseguard.other.v9"}).encode()) is None
    with pytest.raises(ValueError, match="versioned trust model"):
        decode(json.dumps({"type": TRUST_MODEL_PUBLISHED, "trust_model": {}}).encode())
    alien = {**model.to_dict(), "format": 1}
    with pytest.raises(ValueError, match="made by an older version"):
        decode(json.dumps({"type": TRUST_MODEL_PUBLISHED, "trust_model": alien}).encode())
    with pytest.raises(ValueError, match="save the trust model"):
        encode_trust_model(trust_model("tiny-llama", 0.0, "2025-01-01T00:00:00+00:00"), "x")


def test_judge_takes_the_newest_model_that_arrived_and_keeps_a_pinned_one(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path)
    stored = TrustStore(settings.trust_dir).save(
        trust_model("tiny-llama", 1.0, "2025-01-02T00:00:00+00:00")
    )
    older = published(tmp_path / "w", trust_model("tiny-llama", 2.0, "2025-01-01T00:00:00+00:00"))
    newer = published(tmp_path / "w", trust_model("tiny-llama", 3.0, "2025-01-03T00:00:00+00:00"))
    dense = published(
        tmp_path / "w", trust_model("tiny-llama", 4.0, "2025-01-04T00:00:00+00:00", "dense")
    )
    other = published(tmp_path / "w", trust_model("other", 5.0, "2025-01-05T00:00:00+00:00"))
    current = load_judge(settings, "tiny-llama")
    assert serving_versions(current) == {"default": stored.version, "balanced": stored.version}
    assert serving_versions(reload_judge(settings, "tiny-llama", current, [older])) == (
        serving_versions(current)
    )
    judge = reload_judge(settings, "tiny-llama", current, [older, newer, dense, other])
    assert serving_versions(judge) == {
        "default": dense.version,
        "dense": dense.version,
        "balanced": newer.version,
    }
    assert judge.baseline is current.baseline  # the served model's silence history stays
    pinned = settings.model_copy(update={"trust": TrustSettings(model_version=stored.version)})
    kept = reload_judge(pinned, "tiny-llama", current, [newer])
    assert serving_versions(kept) == {"default": stored.version}


def test_a_route_with_its_own_mode_is_judged_by_that_modes_newest_models(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The chat route is judged by the closed-mode models (fit on questions without their
    passage), the other routes and regenerated answers (route None) by the serve-mode ones;
    a closed-mode model that arrives later replaces the stored one; with none, the route is
    judged like the others and the log names the fix."""
    chat, store = "/v1/chat/completions", TrustStore(tmp_path / "trust")
    serve_model = store.save(trust_model("tiny-llama", 2.0, "2025-01-01T00:00:00+00:00"))
    bare = Settings(home=tmp_path, trust=TrustSettings(route_modes={chat: "closed"}))
    caplog.set_level(logging.WARNING, logger="services.gateway")
    assert load_judge(bare, "tiny-llama").routes == {}
    assert "no closed-mode trust model" in caplog.text and "--mode closed" in caplog.text
    closed = store.save(trust_model("tiny-llama", -2.0, "2025-01-02T00:00:00+00:00", mode="closed"))
    judge = load_judge(bare, "tiny-llama")
    assert serving_versions(judge) == {
        "default": serve_model.version,
        "balanced": serve_model.version,
        f"{chat} default": closed.version,
        f"{chat} balanced": closed.version,
    }
    stats = _stats([0.1, 0.1, 0.1, 0.1])
    assert judge.assess(stats, "p", False, chat).score == pytest.approx(0.119, abs=1e-3)
    for route in (None, "/v1/messages"):
        assert judge.assess(stats, "p", False, route).score == pytest.approx(0.881, abs=1e-3)
    newer = published(
        tmp_path / "w", trust_model("tiny-llama", 0.0, "2025-01-03T00:00:00+00:00", mode="closed")
    )
    with pytest.raises(ValueError, match="a proxy gateway judges another model's answers"):
        Settings(home=tmp_path, trust=bare.trust, gateway=GatewaySettings(mode="proxy"))
    reloaded = reload_judge(bare, "tiny-llama", judge, [newer])
    assert reloaded.assess(stats, "p", False, chat).score == pytest.approx(0.5, abs=1e-3)
    assert serving_versions(reloaded)["default"] == serve_model.version
    with pytest.raises(ValueError, match="route_modes maps a route"):
        TrustSettings(route_modes={"/v1/chat": "closed"})
    with pytest.raises(ValueError, match="closed"):
        TrustSettings(route_modes={chat: "book"})


def test_gateway_scores_by_the_rule_until_a_published_trust_model_arrives(
    kafka_broker: Broker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    telemetry = TelemetrySettings(bootstrap_servers=kafka_broker.bootstrap, partitions=1)
    settings = Settings(home=tmp_path / "gateway", telemetry=telemetry)  # no trust model there
    worker_store = tmp_path / "worker"  # the fit's host: no disk shared with the gateway
    caplog.set_level(logging.INFO, logger="services.gateway")
    app = create_app(settings, engine=tiny_engine(), sink=RecordingSink())
    with serve(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        runtime = app.state.runtime
        assert runtime.control is not None and runtime.control.ready.wait(30)
        assert client.get("/admin/status").json()["trust_models"] == {"default": None}
        before = client.post("/v1/chat/completions", json=CHAT)
        first_judge = runtime.trust
        # Another model's, a malformed one, then ours, which scores every answer near 0.
        alien = trust_model("other", -50.0, "2025-01-01T00:00:00+00:00")
        publish_trust_model(telemetry, published(worker_store, alien), "test")
        _send_raw(telemetry, json.dumps({"type": TRUST_MODEL_PUBLISHED, "trust_model": []}))
        ours = published(
            worker_store, trust_model("tiny-llama", -50.0, "2025-01-02T00:00:00+00:00")
        )
        publish_trust_model(telemetry, ours, "first-serve")
        wait_until(lambda: runtime.trust is not first_judge, timeout_s=30, every_s=0.1)
        after = client.post("/v1/chat/completions", json=CHAT)
        status = client.get("/admin/status").json()
    assert before.status_code == after.status_code == 200
    assert float(before.headers["x-ir-trust"].split(";")[0]) > 0.01  # 1 - late-layer silence
    assert after.headers["x-ir-trust"].startswith("0.000;")
    assert "low-score" in after.headers["x-ir-trust"]
    assert "action=flag" in after.headers["x-ir-trust"]  # acted on: its fit is above chance
    assert status["trust_models"] == {"default": ours.version, "balanced": ours.version}
    assert status["trust_at_chance"] == []
    assert runtime.trust.baseline is first_judge.baseline
    # Kept in the gateway's own store: a restart starts on it, and the other model's is not.
    assert serving_versions(load_judge(settings, "tiny-llama")) == status["trust_models"]
    assert [p.stem for p in settings.trust_dir.glob("trust-*.json")] == [ours.version]
    assert "rule score" in caplog.text and "skipped control message" in caplog.text
    assert "trust model of tiny-llama: {'default': None} -> " in caplog.text


def qa_items(engine: Engine, n: int, max_new_tokens: int) -> list[QAItem]:
    """Items the engine answers right (its own answer is the gold one) and wrong, alternately."""
    asked = [QAItem(f"Question number {i}?", ("zzqx never said",)) for i in range(n)]
    said = [r.answer for r in answer_all(engine, asked, range(n), Level.DENSE, max_new_tokens)]
    return [
        QAItem(item.question, (text,)) if i % 2 == 0 and normalise_answer(text) else item
        for i, (item, text) in enumerate(zip(asked, said, strict=True))
    ]


def write_qa(path: Path, items: list[QAItem]) -> Path:
    rows = [{"question": item.question, "answers": list(item.answers)} for item in items]
    path.write_text("\n".join(json.dumps(row) for row in rows), encoding="utf-8")
    return path


def trust_messages(bootstrap: str, topic: str) -> list[TrustModelPublished]:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, consumer_timeout_ms=3000)
    try:
        consumer.assign([TopicPartition(topic, 0)])
        consumer.seek_to_beginning()
        found = [decode(record.value) for record in consumer]
    finally:
        consumer.close()
    return [m for m in found if isinstance(m, TrustModelPublished)]


def test_trust_fit_job_fits_a_model_per_level_once_publishes_and_skips_those_that_exist(
    kafka_broker: Broker, tmp_path: Path
) -> None:
    telemetry = TelemetrySettings(bootstrap_servers=kafka_broker.bootstrap, partitions=1)
    trust = TrustSettings(flag_requests=30)  # healthy answers a kind and level: fewer, for CI
    settings = Settings(home=tmp_path, telemetry=telemetry, trust=trust)
    engine = tiny_engine(cache=False)
    qa = write_qa(tmp_path / "qa.jsonl", qa_items(engine, 20, 3))
    params = {"data": str(qa), "n": 10, "level": "dense,balanced", "max_new_tokens": 3,
              "if_missing": True}  # fmt: skip
    fit_half = len(qa_sample(load_qa(str(qa), tmp_path), "fit", 10))  # the other half: eval
    first = fit_trust(settings, ClaimedJob(1, "trust_fit", "first-serve", params, 1), engine)
    retried = fit_trust(settings, ClaimedJob(1, "trust_fit", "first-serve", params, 2), engine)
    second = fit_trust(settings, ClaimedJob(2, "trust_fit", "first-serve", params, 1), engine)
    rest = {**params, "level": "balanced,all"}  # the levels not fit yet: conservative, aggressive
    third = fit_trust(settings, ClaimedJob(3, "trust_fit", "x", rest, 1), engine)
    with pytest.raises(ValueError, match="unknown level"):
        fit_trust(settings, ClaimedJob(4, "trust_fit", "x", {"level": "turbo"}, 1), engine)
    with pytest.raises(ValueError, match="Extra inputs"):
        fit_trust(settings, ClaimedJob(5, "trust_fit", "x", {"levels": ["dense"]}, 1), engine)
    store = TrustStore(settings.trust_dir)
    models = {level.value: store.latest("tiny-llama", level.value) for level in Level}
    versions = {level: model.version for level, model in models.items()}
    assert {level: m["version"] for level, m in first["models"].items()} == {
        "dense": versions["dense"],
        "balanced": versions["balanced"],
    }
    assert retried["models"] == first["models"] and second["models"] == {}
    assert second["skipped"] == {"dense": versions["dense"], "balanced": versions["balanced"]}
    assert list(third["models"]) == ["conservative", "aggressive"] and third["unfit"] == []
    assert all(
        m["items"] == fit_half and 0 < m["right"] < fit_half for m in first["models"].values()
    )
    assert all(  # the honest figures beside the optimistic one (None: a fold of one class)
        m[k] == models[level].fit_data[k] and (m[k] is None or 0 <= m[k] <= 1)
        for level, m in first["models"].items()
        for k in ("cv_auroc", "nested_auroc", "chance_auroc")
    )
    # Each model fit on answers at its own level, and given flag thresholds at every level.
    assert {level: m.fit_data["level"] for level, m in models.items()} == {v: v for v in versions}
    assert models["dense"].weights != models["balanced"].weights
    assert all(set(m.flag_fit) == set(versions) for m in models.values())
    # From up to 30 healthy answers of each kind (the tiny model's short context skips the
    # longer prompts), each kind's category kept.
    asked = models["dense"].flag_fit["dense"]["kinds"]
    assert set(asked) == set(trust.flag_kinds)
    assert all(0 < v["requests"] <= 30 for v in asked.values())
    assert models["dense"].flag_categories == {"chat": "text", "qa": "text", "code": "code",
                                               "prose": "text"}  # fmt: skip
    assert models["dense"].fit_data["job_id"] == 1
    assert models["dense"].fit_data["reason"] == "first-serve"
    assert len(list(settings.trust_dir.glob("trust-*.json"))) == 4
    messages = trust_messages(kafka_broker.bootstrap, telemetry.control_topic)
    published_first = sorted([versions["dense"], versions["balanced"]])
    assert sorted(m.model.version for m in messages[:4]) == sorted(published_first * 2)
    assert [m.model.version for m in messages[4:]] == [
        versions["conservative"],
        versions["aggressive"],
    ]


def test_a_level_whose_answers_cannot_be_fit_is_passed_over_and_none_fails(
    tmp_path: Path,
) -> None:
    """Every answer wrong: of several levels, each is logged and passed over, and a job that
    fits none fails naming them; a level asked for alone fails with the fit's own reason."""
    settings, engine = Settings(home=tmp_path), tiny_engine(cache=False)
    asked = [QAItem(f"Question number {i}?", ("zzqx never said",)) for i in range(20)]
    params = {"data": str(write_qa(tmp_path / "qa.jsonl", asked)), "n": 10, "max_new_tokens": 3}
    with pytest.raises(ValueError, match="no trust model at dense, balanced: the answers"):
        fit_trust(
            settings,
            ClaimedJob(1, "trust_fit", "x", {**params, "level": "dense,balanced"}, 1),
            engine,
        )
    with pytest.raises(ValueError, match="both right and wrong"):
        fit_trust(
            settings, ClaimedJob(2, "trust_fit", "x", {**params, "level": "dense"}, 1), engine
        )
    assert not list(settings.trust_dir.glob("trust-*.json"))


def test_a_fit_spec_names_its_levels_in_order_and_all_adds_the_served_rest() -> None:
    served = [Level.AGGRESSIVE, Level.DENSE, Level.BALANCED]
    assert FitSpec(level="Balanced, all").level == "balanced,all"
    assert FitSpec(level="balanced,all").levels(served) == [
        Level.BALANCED,
        Level.DENSE,
        Level.AGGRESSIVE,
    ]
    assert FitSpec(level="aggressive,dense").levels(served) == [Level.AGGRESSIVE, Level.DENSE]
    assert FitSpec(level="all").levels(served) == [Level.DENSE, Level.BALANCED, Level.AGGRESSIVE]
    with pytest.raises(ValueError, match="no calibration at conservative"):
        FitSpec(level="balanced,conservative").levels(served)
    with pytest.raises(ValueError, match="names a level twice"):
        FitSpec(level="dense,all,dense")
    with pytest.raises(ValueError, match="unknown level"):
        FitSpec(level="dense,turbo")


def test_closed_mode_answers_the_fit_half_without_the_passages(tmp_path: Path) -> None:
    """`trust fit --mode closed` answers the same fit half (drawn by passage) as serve mode,
    with each question asked alone, as a route that retrieves is asked it."""
    engine, settings = tiny_engine(cache=False), Settings(home=tmp_path)
    passage = "Passage {}: the keeper's word is marmalade."
    rows = [{"question": f"Question number {i}?", "answers": ["zzqx"],
             "context": passage.format(i // 2)} for i in range(24)]  # fmt: skip
    path = tmp_path / "qa.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows), encoding="utf-8")
    spec = FitSpec(data=str(path), n=8, level="dense", max_new_tokens=4, mode="closed")
    closed = answers(settings, engine, spec)
    served = answers(settings, engine, spec.model_copy(update={"mode": "serve"}))
    items = load_qa(str(path), tmp_path)
    indices = qa_sample(items, "fit", 8)
    alone = [QAItem(items[i].question, items[i].answers) for i in range(len(items))]
    expected = answer_all(engine, alone, indices, Level.DENSE, 4)
    assert [r.index for r in closed] == [r.index for r in served] == list(indices)
    assert [r.answer for r in closed] == [r.answer for r in expected]
    assert [r.answer for r in closed] != [r.answer for r in served]
    assert all(r.signals.readout is not None for r in closed)  # what the model reads
    cached = [p.name for p in (settings.trust_dir / "records").iterdir()]
    assert len(cached) == 2 and sum(n.startswith("closed-") for n in cached) == 1  # kept apart


def test_up_queues_the_first_trust_fit_only_when_the_served_model_has_none(tmp_path: Path) -> None:
    model_dir = tmp_path / "models" / "tiny-llama"
    (model_dir).mkdir(parents=True)
    (model_dir / "config.json").write_text("{}")  # resolved by path: only its name is read
    settings = Settings(home=tmp_path, engine=EngineSettings(model=str(model_dir)))
    upgrade(settings.database_url)
    job_id = queue_trust_fit(settings, 50)
    assert job_id is not None
    assert _task_in_broker(settings) == ("sparseguard.trust_fit", [job_id])
    TrustStore(settings.trust_dir).save(trust_model("tiny-llama", 0.0, "2025-01-01T00:00:00+00:00"))
    assert queue_trust_fit(settings, 50) is None
    engine = make_engine(settings.database_url)
    try:
        with session_factory(engine)() as session:
            (job,) = session.query(JobRun).all()
    finally:
        engine.dispose()
    assert (job.id, job.kind, job.reason, job.status) == (
        job_id,
        "trust_fit",
        "first-serve",
        "queued",
    )
    assert job.params == {"n": 50, "level": "balanced,all", "if_missing": True, "data": "halueval",
                          "split": "fit", "mode": "serve", "max_new_tokens": 32}  # fmt: skip
