"""Integration on the real SmolLM2-135M-Instruct (fetched once into the cache)."""

from __future__ import annotations

import pytest

from sparse_engine.artefacts import CalibrationStore
from sparse_engine.engine import Engine, GenerationRequest
from sparse_engine.loader import LoadedModel
from sparse_engine.plan import Level

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def engine(smollm: LoadedModel, calibrated_store: CalibrationStore) -> Engine:
    return Engine.from_store(smollm, calibrated_store)


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
    engine: Engine, calibrated_store: CalibrationStore, smollm: LoadedModel
) -> None:
    plan = engine.plan(Level.BALANCED)
    assert plan.calibration_version is not None
    reloaded = calibrated_store.load(plan.calibration_version)
    assert reloaded.plan() == plan
    assert reloaded.level == "balanced" and reloaded.data["corpus"] == "wiki"
    assert reloaded.weights_sha256 == smollm.weights_sha256
    assert reloaded.perplexity_change_pct <= 2.0
    assert reloaded.realised_sparsity >= 0.3
