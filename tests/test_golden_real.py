"""The golden-set check on the real SmolLM2 and the packaged data (slow): the default set holds
external references only, and on a few of its items the dense plan against itself is ok with
drift exactly 0, the session's balanced calibration raises nothing, and the balanced plan
scaled to 95 % sparsity is over budget, so GoldenDriftHigh fires through the stored runs, the
aggregator's samples and the evaluator, as in production.

At 80 % the drift is inconclusive on these items (6.4 points [-1.0, 14.4]) and on the first 40
HaluEval items (8.6 [2.9, 15.7]); on the whole 100-item set it is over budget (7.45 [3.70,
11.48]; README), which takes minutes, so CI checks a broken plan on a few items. At 90 % these
22 items were over budget on AMD EPYC machines but inconclusive on an Intel Xeon (10.04
[2.90, 17.40]: the dense model scores only 14.4 points here, so the drift has little room);
95 % gave 12.55 [7.43, 18.39] there, and 90 % on 40 + 2 items 13.30 [7.13, 20.41]."""

from __future__ import annotations

import json
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from alerts.evaluator import EvalState, evaluate
from alerts.rules import DEFAULT_RULES, load_rules
from services.aggregator.job_figures import job_samples
from services.aggregator.metrics import AggregatorMetrics
from services.config import Settings
from services.storage.db import make_engine, session_factory, upgrade
from services.workers import drift, golden
from services.workers.golden_score import OK, OVER_BUDGET, LevelDrift
from services.workers.golden_set import GoldenItem, load_golden
from services.workers.jobs import ClaimedJob
from sparse_engine.calibration.store import CalibrationStore
from sparse_engine.data.corpora import load_texts
from sparse_engine.data.splits import evaluation_tokens
from sparse_engine.model.loader import LoadedModel
from sparse_engine.runtime import kernels
from sparse_engine.runtime.engine import Engine
from sparse_engine.sparsity.plan import Level, SparsityPlan
from sparse_engine.sparsity.scaled import TOLERANCE, realised_sparsity, scale_to_sparsity

pytestmark = pytest.mark.slow
NOW = datetime(2026, 12, 8, 3, 0, tzinfo=UTC)
# A few items of the default set keep this to a few minutes on 2 cores: short answers (F1,
# capped at SHORT_ANSWER_TOKENS) and two MT-Bench questions at a short answer length.
HALUEVAL_ITEMS, MTBENCH_ITEMS, MAX_NEW_TOKENS = 20, 2, 32
BROKEN_SPARSITY = 0.95


@pytest.fixture(scope="module")
def default_set(home: Path, tmp_path_factory: pytest.TempPathFactory) -> list[GoldenItem]:
    settings = Settings(home=tmp_path_factory.mktemp("golden"), cache_dir=home)
    return load_golden(golden.ensure_default_golden(settings))


def test_the_default_set_has_external_references_only(
    default_set: list[GoldenItem], home: Path, tmp_path: Path
) -> None:
    counts = Counter((item.source, item.metric) for item in default_set)
    assert counts == {("gpt-4", "chrf"): 30, ("halueval", "f1"): 70}
    assert len({item.id for item in default_set}) == 100
    qa = next(item for item in default_set if item.source == "halueval")
    assert qa.prompt.startswith("Use this passage to answer.\n\nPassage: ")
    assert qa.prompt.endswith("\nAnswer in a few words.") and len(qa.reference.split()) <= 8
    settings = Settings(home=tmp_path, cache_dir=home)
    path = golden.ensure_default_golden(settings)
    path.write_text(path.read_text().splitlines()[0] + "\n")
    assert golden.ensure_default_golden(settings) == path  # an existing file is left alone
    assert json.loads(path.read_text())["metric"] == "chrf"


@pytest.fixture(scope="module")
def results(
    smollm: LoadedModel,
    calibrated_store: CalibrationStore,
    home: Path,
    default_set: list[GoldenItem],
) -> dict[str, LevelDrift]:
    balanced = calibrated_store.latest_plans(smollm.weights_sha256)[Level.BALANCED]
    ids = evaluation_tokens(smollm.tokenizer, load_texts("wiki", home), 512)
    broken = scale_to_sparsity(smollm, balanced, ids, BROKEN_SPARSITY)
    assert abs(realised_sparsity(smollm, broken, ids) - BROKEN_SPARSITY) <= TOLERANCE
    items = [
        *[i for i in default_set if i.source == "gpt-4"][:MTBENCH_ITEMS],
        *[i for i in default_set if i.source == "halueval"][:HALUEVAL_ITEMS],
    ]
    plans = {"dense-self": SparsityPlan(), "balanced": balanced, "balanced-at-95%": broken}
    engine = Engine(smollm, {})
    engine.enable_fast_path(native=kernels.load())  # the decode path the nightly job serves
    found = golden.compare(engine, items, plans, MAX_NEW_TOKENS)
    return {result.level: result for result in found}


def firing(results: dict[str, LevelDrift], tmp_path: Path) -> set[str]:
    """The levels GoldenDriftHigh fires for when these runs are the night's check."""
    settings = Settings(home=tmp_path)
    upgrade(settings.database_url)
    sessions = session_factory(make_engine(settings.database_url))
    job = ClaimedJob(1, "golden_check", "schedule", {}, 1)
    with sessions.begin() as session:
        drift.record(session, settings, "smollm", list(results.values()), job, NOW)
    with sessions() as session:
        samples = job_samples(session, NOW, AggregatorMetrics(CollectorRegistry()))
    rules = [
        r
        for r in load_rules(DEFAULT_RULES, settings.signals.as_thresholds())
        if r.name == "GoldenDriftHigh"
    ]
    _, transitions = evaluate(EvalState(), rules, samples, NOW, 3600.0)
    return {t.labels["level"] for t in transitions if t.state == "firing"}


def test_dense_against_itself_is_ok_with_no_drift(results: dict[str, LevelDrift]) -> None:
    same = results["dense-self"]
    assert (same.drift, same.drift_low, same.drift_high) == (0.0, 0.0, 0.0)
    assert same.answers_changed == 0 and same.status(Settings().signals.drift_budget) == OK
    assert same.kl_mean == pytest.approx(0.0, abs=1e-4)


def test_a_healthy_calibration_raises_nothing_and_95_percent_is_over_budget(
    results: dict[str, LevelDrift], tmp_path: Path
) -> None:
    budget = Settings().signals.drift_budget
    healthy, broken = results["balanced"], results["balanced-at-95%"]
    assert healthy.status(budget) != OVER_BUDGET
    assert broken.status(budget) == OVER_BUDGET, broken.figures(budget)
    assert broken.drift_low > budget and broken.drift > healthy.drift
    assert broken.kl_mean > healthy.kl_mean
    assert firing(results, tmp_path) == {"balanced-at-95%"}
