"""Integration on the real SmolLM2-135M-Instruct (fetched once into the cache)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparse_engine.artefacts import CalibrationStore
from sparse_engine.calibrate import CalibrationConfig, calibrate, prepare_data
from sparse_engine.corpora import load_texts
from sparse_engine.engine import Engine, GenerationRequest
from sparse_engine.loader import LoadedModel, load_model
from sparse_engine.models import DEFAULT_MODEL, resolve_model
from sparse_engine.plan import Level

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# Small enough for CI; `make run` and `make bench` use the full defaults.
CFG = CalibrationConfig(samples=16, seq_len=256, heldout_tokens=1024)


@pytest.fixture(scope="module")
def smollm(home: Path) -> LoadedModel:
    return load_model(resolve_model(DEFAULT_MODEL, home))


@pytest.fixture(scope="module")
def store(
    smollm: LoadedModel, home: Path, tmp_path_factory: pytest.TempPathFactory
) -> CalibrationStore:
    data = prepare_data(smollm.tokenizer, load_texts("wiki", home), CFG, "wiki")
    store = CalibrationStore(tmp_path_factory.mktemp("calibrations"))
    for cal in calibrate(smollm, data, [Level.BALANCED], CFG):
        store.save(cal)
    return store


@pytest.fixture(scope="module")
def engine(smollm: LoadedModel, store: CalibrationStore) -> Engine:
    return Engine.from_store(smollm, store)


@pytest.mark.parametrize("level", [Level.DENSE, Level.BALANCED])
def test_capital_of_france_is_paris(engine: Engine, level: Level) -> None:
    request = GenerationRequest(messages=QUESTION, max_new_tokens=16, measure_drift=True)
    stats = engine.generate(request, level).result()
    assert "Paris" in stats.text
    assert stats.signals is not None
    if level is Level.BALANCED:
        assert stats.signals.sparsity_ratio > 0.3
        assert 0.5 < stats.signals.gate_confidence < 1.0
        assert stats.semantic_drift_kl is not None and stats.semantic_drift_kl >= 0
        assert len(stats.signals.silence_rate_per_layer) == 30
    else:
        assert stats.signals.sparsity_ratio == 0.0 and stats.semantic_drift_kl == 0.0


def test_balanced_calibration_round_trips(
    engine: Engine, store: CalibrationStore, smollm: LoadedModel
) -> None:
    plan = engine.plan(Level.BALANCED)
    assert plan.calibration_version is not None
    reloaded = store.load(plan.calibration_version)
    assert reloaded.plan() == plan
    assert reloaded.level == "balanced" and reloaded.data["corpus"] == "wiki"
    assert reloaded.weights_sha256 == smollm.weights_sha256
    assert reloaded.perplexity_change_pct <= 2.0
    assert reloaded.realised_sparsity >= 0.3
