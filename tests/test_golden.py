"""The golden-set drift check: the JSONL file (with its per-item metric) and its errors,
freezing and checking on the tiny engine, the default set's pieces, the stored runs and the 0004
migration on a real SQLite database, and the CLI. Scores, the bootstrap and one level's drift:
tests/test_golden_score.py; the real SmolLM2 and the packaged data: tests/test_golden_real.py
(slow)."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command

from services.cli import main
from services.config import JobSettings, Settings
from services.storage.db import alembic_config, make_engine, session_factory, upgrade
from services.storage.models import GoldenRun
from services.workers import golden, golden_default, golden_score, golden_set
from services.workers.golden_score import OVER_BUDGET
from services.workers.golden_set import GoldenItem
from sparse_engine.data.corpora import HaluEvalItem, MTBenchQuestion
from sparse_engine.runtime.engine import Engine
from sparse_engine.sparsity.plan import Level
from tests.tiny import tiny_engine

T0 = datetime(2025, 6, 1, 3, 0, tzinfo=UTC)
PROMPTS = [("a", "Hello there"), ("b", "What is sparsity?")]
SENTENCES = [
    "The cat sat on the mat near the door .",
    "Sparse models skip work that would multiply by zero .",
    "Calibration picks one threshold for every layer of the model .",
]
BUDGET = 2.0


def items_for(references: list[str], metric: str = "chrf") -> list[GoldenItem]:
    return [
        GoldenItem(f"q{i}", f"prompt {i}", ref, "test", metric) for i, ref in enumerate(references)
    ]


# --- the file ---------------------------------------------------------------------------------


def test_golden_file_round_trips_atomically(tmp_path: Path) -> None:
    path = tmp_path / "golden" / "set.jsonl"
    items = [
        GoldenItem("1", "Say it in French.", "déjà vu — café", "gpt-4", "chrf"),
        GoldenItem("two", "Say nothing.", "", "dense:tiny-llama", "bleu"),
        GoldenItem("3", "Capital of France?", "Paris", "halueval", "f1"),
    ]
    golden_set.write_golden(path, items)
    assert golden_set.load_golden(path) == items
    assert json.loads(path.read_text().splitlines()[2])["metric"] == "f1"
    assert [p.name for p in path.parent.iterdir()] == ["set.jsonl"]  # no temp file left


def test_failed_write_leaves_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "set.jsonl"
    golden_set.write_golden(path, items_for(["x"]))
    before = path.read_bytes()
    with pytest.raises(ValueError, match="duplicate id 'q0'"):
        golden_set.write_golden(path, items_for(["x"]) * 2)
    assert path.read_bytes() == before
    with pytest.raises(ValueError, match="no items"):
        golden_set.write_golden(path, [])


def test_files_from_before_the_metric_field_still_load(tmp_path: Path) -> None:
    path = tmp_path / "set.jsonl"
    long = "A frozen dense answer that goes on for well over eight words like they do."
    rows = [
        {"id": 81, "prompt": "p", "reference": "Paris"},
        {"id": "d", "prompt": "p", "reference": long, "source": "dense:m"},
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + "\n")
    assert golden_set.load_golden(path) == [
        GoldenItem("81", "p", "Paris", "unknown", "f1"),  # a few words: a short answer
        GoldenItem("d", "p", long, "dense:m", "chrf"),
    ]
    assert GoldenItem("x", "p", "Paris") == GoldenItem("x", "p", "Paris", metric="f1")


@pytest.mark.parametrize(
    ("lines", "error"),
    [
        (['{"id": "a", "prompt": "p", "reference": "r"}', "{oops"], r":2: not valid JSON"),
        (['{"id": "a", "prompt": "p"}'], r':1: "reference" must be a non-empty string'),
        (['{"id": "a", "prompt": " ", "reference": "r"}'], r':1: "prompt" must be'),
        (['["a", "p", "r"]'], r":1: expected a JSON object, got list"),
        (['{"id": true, "prompt": "p", "reference": "r"}'], r':1: "id" must be'),
        (
            ['{"id": "a", "prompt": "p", "reference": "r", "metric": "rouge"}'],
            r':1: "metric" must be one of f1, chrf, bleu, got \'rouge\'',
        ),
        (['{"id": "a", "prompt": "p", "reference": "r", "metric": 3}'], r':1: "metric" must'),
        (
            ['{"id": "a", "prompt": "p", "reference": "r"}'] * 2,
            r"set\.jsonl: duplicate id 'a'",
        ),
        ([], r"set\.jsonl has no items"),
    ],
)
def test_bad_golden_files_name_file_and_line(tmp_path: Path, lines: list[str], error: str) -> None:
    path = tmp_path / "set.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=error) as info:
        golden_set.load_golden(path)
    assert str(path) in str(info.value)


def test_an_item_with_an_unknown_metric_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown metric 'rouge'; choose one of: f1, chrf"):
        GoldenItem("a", "p", "r", metric="rouge")


def test_read_prompts_from_text_and_jsonl(tmp_path: Path) -> None:
    text = tmp_path / "prompts.txt"
    text.write_text("First prompt?\n\n  Second prompt.  \n")
    assert golden_set.read_prompts(text) == [
        ("prompts-1", "First prompt?"),
        ("prompts-2", "Second prompt."),
    ]
    jsonl = tmp_path / "mine.jsonl"
    jsonl.write_text('{"id": "x", "prompt": "One"}\n{"prompt": "Two"}\n')
    assert golden_set.read_prompts(jsonl) == [("x", "One"), ("mine-2", "Two")]
    jsonl.write_text('{"id": "x", "prompt": "One"}\n{"id": "x", "prompt": "Two"}\n')
    with pytest.raises(ValueError, match="duplicate id 'x'"):
        golden_set.read_prompts(jsonl)
    with pytest.raises(FileNotFoundError, match="one prompt per line"):
        golden_set.read_prompts(tmp_path / "missing.txt")
    (tmp_path / "blank.txt").write_text("\n \n")
    with pytest.raises(ValueError, match="no prompts"):
        golden_set.read_prompts(tmp_path / "blank.txt")


# --- freeze and check on the tiny engine ---------------------------------------------------


@pytest.fixture(scope="module")
def tiny() -> Engine:
    return tiny_engine(cache=False)


def test_freeze_keeps_the_dense_greedy_answers(tiny: Engine) -> None:
    done: list[int] = []
    items = golden.freeze(tiny, PROMPTS, 12, progress=done.append)
    assert [(i.id, i.prompt) for i in items] == PROMPTS and sum(done) == 2
    assert {i.source for i in items} == {"dense:tiny-llama"}
    assert all(i.reference for i in items)
    assert golden.freeze(tiny, PROMPTS, 12) == items  # greedy: the same answers again


def test_check_compares_each_calibrated_level_with_dense(
    tiny: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    items = [
        GoldenItem(pid, prompt, "a reference answer", "test", "chrf") for pid, prompt in PROMPTS
    ]
    done: list[int] = []
    with caplog.at_level("INFO", logger="services.workers.golden"):
        results = golden.check(tiny, items, ["conservative", "aggressive"], 12, done.append)
    assert [r.level for r in results] == ["conservative", "aggressive"]
    assert sum(done) == len(items) * 3
    assert "golden check aggressive: drift" in caplog.text
    for result in results:
        assert result.calibration_version == f"tiny-{result.level}"
        assert result.prompts == 2 and result.metric == "chrf"
        assert result.drift == pytest.approx(result.score_dense - result.score_sparse)
        assert result.drift_low <= result.drift <= result.drift_high
        rows = result.details["items"]
        assert result.answers_changed == sum(row["dense"] != row["sparse"] for row in rows)
        assert all(math.isfinite(row["kl"]) and row["kl"] >= 0 for row in rows)
    conservative, aggressive = results
    assert aggressive.kl_mean > conservative.kl_mean > 0
    assert aggressive.answers_changed >= 1  # 70 % of MLP inputs zeroed changes the answer


def test_short_answer_items_are_capped(tiny: Engine) -> None:
    short = GoldenItem("s", "Capital of France?", "Paris", "test", "f1")
    long = GoldenItem("l", "Explain sparsity.", SENTENCES[1], "test", "chrf")
    assert golden.answer_tokens(short, 64) == golden.SHORT_ANSWER_TOKENS
    assert golden.answer_tokens(short, 8) == 8
    assert golden.answer_tokens(long, 64) == 64


def test_dense_references_are_warned_about(tiny: Engine, caplog: pytest.LogCaptureFixture) -> None:
    engine = Engine(tiny.lm, {Level.BALANCED: tiny.plans[Level.BALANCED]})
    items = golden.freeze(engine, PROMPTS[:1], 4)
    with caplog.at_level("INFO", logger="services.workers.golden"):
        results = golden.check(engine, items, ["dense", "balanced", "aggressive"], 4)
    assert [r.level for r in results] == ["balanced"]
    assert "skips aggressive" in caplog.text
    assert "1 golden references are dense-model answers" in caplog.text
    with pytest.raises(ValueError, match="unknown level 'sideways'"):
        golden.check(engine, items, ["sideways"], 4)
    with pytest.raises(ValueError, match="golden set is empty"):
        golden.check(engine, [], ["balanced"], 4)


# --- the default set's pieces (no model: every reference is external) ---------------------------


def test_mtbench_items_are_the_questions_with_a_gpt4_reference() -> None:
    questions = [
        MTBenchQuestion(1, "writing", ("Write a haiku.", "Another?")),
        MTBenchQuestion(2, "math", ("What is 2+2?", "And 3+3?")),
    ]
    assert golden_default.mtbench_golden(questions, {2: "2 + 2 = 4, because ..."}) == [
        GoldenItem("mtbench-2", "What is 2+2?", "2 + 2 = 4, because ...", "gpt-4", "chrf")
    ]


def test_halueval_items_are_spread_and_asked_with_their_passage() -> None:
    data = [HaluEvalItem(f"Passage {i}.", f" Question {i}?", f"Answer {i}") for i in range(10)]
    items = golden_default.halueval_golden(data, 3)
    assert [i.id for i in items] == ["halueval-0", "halueval-3", "halueval-6"]
    assert {(i.source, i.metric) for i in items} == {("halueval", "f1")}
    assert items[1].reference == "Answer 3"
    assert items[1].prompt == (
        "Use this passage to answer.\n\nPassage: Passage 3.\n\n"
        "Question: Question 3?\nAnswer in a few words."
    )
    assert golden_default.halueval_golden(data, 0) == []
    with pytest.raises(ValueError, match="asked for 11 HaluEval items but the data set has 10"):
        golden_default.halueval_golden(data, 11)
    with pytest.raises(ValueError, match=">= 0"):
        golden_default.halueval_golden(data, -1)


def test_a_configured_golden_set_must_exist(tmp_path: Path) -> None:
    custom = tmp_path / "mine.jsonl"
    settings = Settings(home=tmp_path, jobs=JobSettings(golden_set=custom))
    with pytest.raises(FileNotFoundError, match="sparseguard golden create"):
        golden.ensure_default_golden(settings)
    assert Settings(home=tmp_path).golden_set_path.name == "external-v1.jsonl"


# --- stored runs ---------------------------------------------------------------------------------


def migrated(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'sparseguard.db'}"
    upgrade(url)
    return url


def test_runs_are_stored_averaged_on_their_lower_bound_and_dated(tmp_path: Path) -> None:
    factory = session_factory(make_engine(migrated(tmp_path)))
    items = items_for(SENTENCES)
    low = golden_score.summarize("balanced", "v1", items, SENTENCES, SENTENCES, [0.0] * 3)
    high = golden_score.summarize("balanced", "v1", items, SENTENCES, ["x", "y", "z"], [1.0] * 3)
    with factory.begin() as session:
        assert golden.last_run_at(session) is None
        assert golden.drift_low_average(session, "m", "balanced", T0) is None
        golden.store_runs(session, "m", [low], T0, BUDGET)
        golden.store_runs(session, "m", [high], T0 + timedelta(hours=12), BUDGET)
        golden.store_runs(session, "other", [low], T0 + timedelta(hours=20), BUDGET)
    with factory() as session:
        both = golden.drift_low_average(session, "m", "balanced", T0)
        assert both == pytest.approx((low.drift_low + high.drift_low) / 2)
        later = golden.drift_low_average(session, "m", "balanced", T0 + timedelta(hours=1))
        assert later is not None and later == pytest.approx(high.drift_low) and later > 0
        assert golden.drift_low_average(session, "m", "aggressive", T0) is None
        assert golden.last_run_at(session, "m") == T0 + timedelta(hours=12)
        assert golden.last_run_at(session) == T0 + timedelta(hours=20)
        assert golden.last_run_at(session, "nobody") is None


def test_stored_run_keeps_every_figure(tmp_path: Path) -> None:
    factory = session_factory(make_engine(migrated(tmp_path)))
    result = golden_score.summarize(
        "aggressive", "v9", items_for(SENTENCES), SENTENCES, ["a"] * 3, [0.2] * 3
    )
    with factory.begin() as session:
        (run,) = golden.store_runs(session, "m", [result], T0, BUDGET)
        run_id = run.id
    with factory() as session:
        stored = session.get(GoldenRun, run_id)
        assert stored is not None
        assert (stored.level, stored.calibration_version, stored.created_at) == (
            "aggressive",
            "v9",
            T0,
        )
        assert (stored.metric, stored.status) == ("chrf", OVER_BUDGET)
        assert stored.drift == pytest.approx(result.drift)
        assert (stored.drift_low, stored.drift_high) == (result.drift_low, result.drift_high)
        assert stored.score_dense == pytest.approx(100.0)
        assert stored.kl_mean == pytest.approx(0.2) and stored.answers_changed == 3
        assert stored.details == json.loads(json.dumps(result.details))


def test_migration_keeps_bleu_runs_without_an_interval(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'sparseguard.db'}"
    config = alembic_config(url)
    command.upgrade(config, "0003")
    engine = make_engine(url)
    with engine.begin() as connection:
        connection.execute(
            sa.text(
                "INSERT INTO golden_runs (model_id, level, calibration_version, bleu_dense, "
                "bleu_sparse, drift_bleu, kl_mean, answers_changed, prompts, created_at, details) "
                "VALUES ('m', 'balanced', 'v1', 20, 18.5, 1.5, 0.1, 3, 10, :at, '{}')"
            ),
            {"at": T0.replace(tzinfo=None)},
        )
    command.upgrade(config, "head")
    factory = session_factory(engine)
    with factory() as session:
        (run,) = session.scalars(sa.select(GoldenRun)).all()
        assert (run.metric, run.drift, run.score_dense) == ("bleu-corpus", 1.5, 20.0)
        assert (run.drift_low, run.drift_high, run.status) == (None, None, None)
        # BLEU runs are another unit: never part of the recalibration mean.
        assert golden.drift_low_average(session, "m", "balanced", T0) is None
    with factory.begin() as session, pytest.raises(sa.exc.IntegrityError):
        session.execute(sa.update(GoldenRun).values(status="bad"))
    command.downgrade(config, "0003")
    with engine.connect() as connection:
        row = connection.execute(sa.text("SELECT bleu_dense, drift_bleu FROM golden_runs")).one()
    assert tuple(row) == (20.0, 1.5)
    engine.dispose()


# --- the CLI -------------------------------------------------------------------------------


def test_create_names_the_fix_for_a_missing_prompt_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SPARSEGUARD_HOME", str(tmp_path))
    out = tmp_path / "golden.jsonl"
    assert (
        main(["golden", "create", "--prompts", str(tmp_path / "nope.txt"), "--out", str(out)]) == 2
    )
    assert "one prompt per line" in capsys.readouterr().err
    out.write_text("kept\n")
    assert (
        main(["golden", "create", "--prompts", str(tmp_path / "nope.txt"), "--out", str(out)]) == 2
    )
    assert "--force" in capsys.readouterr().err and out.read_text() == "kept\n"
    assert main(["golden", "show"]) == 2
    assert "sparseguard golden create" in capsys.readouterr().err


def test_show_counts_items_by_source_and_metric(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SPARSEGUARD_HOME", str(tmp_path))
    path = tmp_path / "set.jsonl"
    golden_set.write_golden(path, items_for(["Paris", "Rome"], "f1"))
    assert main(["golden", "show", "--file", str(path)]) == 0
    shown = capsys.readouterr().out
    assert f"2 items in {path}" in shown and "2  test (f1)" in shown
