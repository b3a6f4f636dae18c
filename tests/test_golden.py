"""The golden-set drift check: the JSONL file and its errors, BLEU drift arithmetic, freezing
and checking on the tiny engine, the stored runs on a real SQLite database, the default
MT-Bench set from the packaged data, and the CLI and the check on the real SmolLM2 (slow)."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.cli import main
from services.config import JobSettings, Settings
from services.storage.db import make_engine, session_factory, upgrade
from services.storage.models import GoldenRun
from services.workers import golden, golden_set
from services.workers.golden_set import GoldenItem
from sparse_engine.calibration.store import CalibrationStore
from sparse_engine.data.corpora import MTBenchQuestion, mtbench_questions, mtbench_references
from sparse_engine.model.loader import LoadedModel
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


def items_for(references: list[str]) -> list[GoldenItem]:
    return [GoldenItem(f"q{i}", f"prompt {i}", ref, "test") for i, ref in enumerate(references)]


# --- the file ---------------------------------------------------------------------------------


def test_golden_file_round_trips_atomically(tmp_path: Path) -> None:
    path = tmp_path / "golden" / "set.jsonl"
    items = [
        GoldenItem("1", "Say it in French.", "déjà vu — café", "gpt-4"),
        GoldenItem("two", "Say nothing.", "", "dense:tiny-llama"),
    ]
    golden_set.write_golden(path, items)
    assert golden_set.load_golden(path) == items
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


def test_source_is_optional_and_ids_may_be_integers(tmp_path: Path) -> None:
    path = tmp_path / "set.jsonl"
    path.write_text('{"id": 81, "prompt": "p", "reference": "r"}\n\n')
    assert golden_set.load_golden(path) == [GoldenItem("81", "p", "r", "unknown")]


@pytest.mark.parametrize(
    ("lines", "error"),
    [
        (['{"id": "a", "prompt": "p", "reference": "r"}', "{oops"], r":2: not valid JSON"),
        (['{"id": "a", "prompt": "p"}'], r':1: "reference" must be a non-empty string'),
        (['{"id": "a", "prompt": " ", "reference": "r"}'], r':1: "prompt" must be'),
        (['["a", "p", "r"]'], r":1: expected a JSON object, got list"),
        (['{"id": true, "prompt": "p", "reference": "r"}'], r':1: "id" must be'),
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


# --- BLEU drift ----------------------------------------------------------------------------


def test_same_answers_have_no_drift_and_changed_ones_are_counted() -> None:
    items = items_for(SENTENCES)
    same = golden.summarize("balanced", "v1", items, SENTENCES, SENTENCES, [0.0, 0.1, 0.2])
    assert same.bleu_dense == pytest.approx(100.0)
    assert same.drift_bleu == 0.0 and same.answers_changed == 0 and same.prompts == 3
    assert same.kl_mean == pytest.approx(0.1)
    assert not same.over_budget(0.8)

    sparse = [SENTENCES[0], "A different answer entirely here .", SENTENCES[2][:20]]
    drifted = golden.summarize("balanced", "v1", items, SENTENCES, sparse, [0.0, 0.5, 0.4])
    assert drifted.answers_changed == 2
    assert drifted.bleu_sparse < drifted.bleu_dense
    assert drifted.drift_bleu == pytest.approx(drifted.bleu_dense - drifted.bleu_sparse)
    assert drifted.over_budget(0.8)
    rows = drifted.details["items"]
    assert [row["changed"] for row in rows] == [False, True, True]
    assert rows[1] == {
        "id": "q1",
        "changed": True,
        "kl": 0.5,
        "dense": SENTENCES[1],
        "sparse": sparse[1],
    }


def test_bleu_is_sacrebleu_corpus_bleu_4() -> None:
    # By hand: 2/4 unigrams (clipped), 1/3 bigrams; no trigram (of 2) or 4-gram (of 1) match,
    # which exp smoothing scores 1/(2*2) and 1/(4*1); equal lengths, so no brevity penalty.
    expected = math.exp((math.log(1 / 2) + math.log(1 / 3) + math.log(1 / 4) + math.log(1 / 4)) / 4)
    assert golden.bleu(["the cat the dog"], ["the cat sat down"]) == pytest.approx(100 * expected)


answers = st.lists(st.text(alphabet="ab .", max_size=12), min_size=1, max_size=6)


@given(answers, st.data())
def test_drift_identity_and_change_count(dense: list[str], data: st.DataObject) -> None:
    sparse = data.draw(
        st.lists(st.sampled_from(["", "a b", "a"]), min_size=len(dense), max_size=len(dense))
    )
    items = items_for(
        data.draw(st.lists(st.text(max_size=8), min_size=len(dense), max_size=len(dense)))
    )
    kls = [0.0] * len(dense)
    same = golden.summarize("aggressive", "v", items, dense, dense, kls)
    assert same.drift_bleu == 0.0 and same.answers_changed == 0
    result = golden.summarize("aggressive", "v", items, dense, sparse, kls)
    assert result.answers_changed == sum(d != s for d, s in zip(dense, sparse, strict=True))
    assert math.isfinite(result.drift_bleu)


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


def test_check_compares_each_calibrated_level_with_dense(tiny: Engine) -> None:
    items = golden.freeze(tiny, PROMPTS, 12)
    done: list[int] = []
    results = golden.check(tiny, items, ["conservative", "aggressive"], 12, progress=done.append)
    assert [r.level for r in results] == ["conservative", "aggressive"]
    assert sum(done) == len(items) * 3
    for result in results:
        assert result.calibration_version == f"tiny-{result.level}"
        assert result.prompts == 2
        # The references are the dense answers, so dense scores full marks on every run.
        assert result.bleu_dense == pytest.approx(100.0)
        assert result.drift_bleu == pytest.approx(result.bleu_dense - result.bleu_sparse)
        rows = result.details["items"]
        assert [row["dense"] for row in rows] == [i.reference for i in items]
        assert result.answers_changed == sum(row["dense"] != row["sparse"] for row in rows)
        assert all(math.isfinite(row["kl"]) and row["kl"] >= 0 for row in rows)
    conservative, aggressive = results
    assert aggressive.kl_mean > conservative.kl_mean > 0
    assert aggressive.answers_changed >= 1  # 70 % of MLP inputs zeroed changes the answer


def test_check_skips_levels_without_calibration(
    tiny: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    engine = Engine(tiny.lm, {Level.BALANCED: tiny.plans[Level.BALANCED]})
    items = golden.freeze(engine, PROMPTS[:1], 4)
    with caplog.at_level("INFO", logger="services.workers.golden"):
        results = golden.check(engine, items, ["dense", "balanced", "aggressive"], 4)
    assert [r.level for r in results] == ["balanced"]
    assert "skips aggressive" in caplog.text
    with pytest.raises(ValueError, match="unknown level 'sideways'"):
        golden.check(engine, items, ["sideways"], 4)
    with pytest.raises(ValueError, match="golden set is empty"):
        golden.check(engine, [], ["balanced"], 4)


def test_mtbench_golden_prefers_packaged_references(tiny: Engine) -> None:
    questions = [
        MTBenchQuestion(1, "writing", ("Write a haiku.", "Another?")),
        MTBenchQuestion(2, "math", ("What is 2+2?", "And 3+3?")),
    ]
    items = golden.mtbench_golden(questions, {2: "4"}, tiny, 6)
    frozen = golden.freeze(tiny, [("mtbench-1", "Write a haiku.")], 6)
    assert items == [frozen[0], GoldenItem("mtbench-2", "What is 2+2?", "4", "gpt-4")]


def test_a_configured_golden_set_must_exist(tiny: Engine, tmp_path: Path) -> None:
    custom = tmp_path / "mine.jsonl"
    settings = Settings(home=tmp_path, jobs=JobSettings(golden_set=custom))
    with pytest.raises(FileNotFoundError, match="sparseguard golden create"):
        golden.ensure_default_golden(settings, tiny)


# --- stored runs -----------------------------------------------------------------------------


def test_runs_are_stored_averaged_and_dated(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'sparseguard.db'}"
    upgrade(url)
    factory = session_factory(make_engine(url))
    items = items_for(SENTENCES)
    low = golden.summarize("balanced", "v1", items, SENTENCES, SENTENCES, [0.0] * 3)
    high = golden.summarize("balanced", "v1", items, SENTENCES, ["x", "y", "z"], [1.0] * 3)
    with factory.begin() as session:
        assert golden.last_run_at(session) is None
        assert golden.drift_average(session, "m", "balanced", T0) is None
        golden.store_runs(session, "m", [low], T0)
        golden.store_runs(session, "m", [high], T0 + timedelta(hours=12))
        golden.store_runs(session, "other", [low], T0 + timedelta(hours=20))
    with factory() as session:
        both = golden.drift_average(session, "m", "balanced", T0)
        assert both == pytest.approx((low.drift_bleu + high.drift_bleu) / 2)
        later = golden.drift_average(session, "m", "balanced", T0 + timedelta(hours=1))
        assert later is not None and later == pytest.approx(high.drift_bleu) and later > 0
        assert golden.drift_average(session, "m", "aggressive", T0) is None
        assert golden.last_run_at(session, "m") == T0 + timedelta(hours=12)
        assert golden.last_run_at(session) == T0 + timedelta(hours=20)
        assert golden.last_run_at(session, "nobody") is None


def test_stored_run_keeps_every_figure(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'sparseguard.db'}"
    upgrade(url)
    factory = session_factory(make_engine(url))
    result = golden.summarize(
        "aggressive", "v9", items_for(SENTENCES), SENTENCES, ["a"] * 3, [0.2] * 3
    )
    with factory.begin() as session:
        (run,) = golden.store_runs(session, "m", [result], T0)
        run_id = run.id
    with factory() as session:
        stored = session.get(GoldenRun, run_id)
        assert stored is not None
        assert (stored.level, stored.calibration_version, stored.created_at) == (
            "aggressive",
            "v9",
            T0,
        )
        assert stored.drift_bleu == pytest.approx(result.drift_bleu)
        assert stored.kl_mean == pytest.approx(0.2) and stored.answers_changed == 3
        assert stored.details == json.loads(json.dumps(result.details))


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


@pytest.mark.slow
def test_golden_create_freezes_smollm_answers(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SPARSEGUARD_HOME", str(tmp_path))
    monkeypatch.setenv("SPARSEGUARD_CACHE_DIR", str(home))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is the capital of France?\nName a primary colour.\n")
    out = tmp_path / "golden.jsonl"
    args = ["golden", "create", "--prompts", str(prompts), "--out", str(out)]
    assert main([*args, "--max-new-tokens", "8"]) == 0
    items = golden_set.load_golden(out)
    assert [i.id for i in items] == ["prompts-1", "prompts-2"]
    assert all(i.reference.strip() and i.source.startswith("dense:") for i in items)
    assert "wrote 2 references" in capsys.readouterr().out
    assert main(["golden", "show", "--file", str(out)]) == 0
    shown = capsys.readouterr().out
    assert f"2 items in {out}" in shown and items[0].source in shown


@pytest.mark.slow
def test_check_on_smollm_balanced(
    smollm: LoadedModel, calibrated_store: CalibrationStore, home: Path
) -> None:
    engine = Engine(smollm, calibrated_store.latest_plans(smollm.weights_sha256))
    references = mtbench_references(home)
    answered = [q for q in mtbench_questions(home) if q.question_id in references][:3]
    items = [
        GoldenItem(str(q.question_id), q.turns[0], references[q.question_id], "gpt-4")
        for q in answered
    ]
    (result,) = golden.check(engine, items, ["balanced"], 16)
    assert result.level == "balanced" and result.prompts == 3
    assert result.calibration_version == engine.plans[Level.BALANCED].calibration_version
    assert all(0.0 <= b <= 100.0 for b in (result.bleu_dense, result.bleu_sparse))
    assert math.isfinite(result.drift_bleu) and math.isfinite(result.kl_mean)
    assert result.kl_mean >= 0.0
    assert 0 <= result.answers_changed <= 3


@pytest.mark.slow
def test_ensure_default_golden_builds_mt_bench_once(
    smollm: LoadedModel, home: Path, tmp_path: Path
) -> None:
    # The tiny model's 512-byte context is too short for MT-Bench prompts: use the real one.
    dense = Engine(smollm, {})
    settings = Settings(home=tmp_path, cache_dir=home, jobs=JobSettings(golden_max_new_tokens=2))
    path = golden.ensure_default_golden(settings, dense)
    assert path == tmp_path / "golden" / "mt-bench.jsonl"
    items = golden_set.load_golden(path)
    references = mtbench_references(home)
    assert len(items) == len(mtbench_questions(home)) == 80
    assert sum(i.source == "gpt-4" for i in items) == len(references)
    assert {i.source for i in items} == {"gpt-4", f"dense:{smollm.model_id}"}
    path.write_text(path.read_text().splitlines()[0] + "\n")
    assert golden.ensure_default_golden(settings, dense) == path  # existing file left alone
    assert len(golden_set.load_golden(path)) == 1
