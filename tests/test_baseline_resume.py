"""An interrupted baseline pass resumes: each level is kept as it is measured, a second run
takes the kept levels and measures only the rest, and once the baselines are attached nothing
is kept (a later pass, after a change, measures afresh). On the tiny model with a few short
prompts; the interruption is a KeyboardInterrupt raised as the balanced level starts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.config import Settings
from services.shared import baseline
from sparse_engine.calibration.baseline import run_prompts
from sparse_engine.calibration.store import CalibrationStore
from sparse_engine.data.traffic import SHARED_SYSTEM, Prompt
from sparse_engine.sparsity.plan import Level
from tests.tiny import calibration_of, tiny_engine

PROMPTS = [
    Prompt("chat", "How do I keep a sourdough starter alive?", SHARED_SYSTEM),
    Prompt("chat", "Name three rivers in Europe."),
    Prompt("code", "def add(a, b):\n    return a + b\n\n# now multiply"),
]


def test_an_interrupted_baseline_pass_resumes_at_the_level_it_stopped_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPARSEGUARD_ENGINE__BASELINE_MAX_NEW_TOKENS", "3")
    monkeypatch.setattr(baseline, "baseline_prompts", lambda settings: PROMPTS)
    settings = Settings(home=tmp_path)
    engine = tiny_engine()
    cal = calibration_of(engine, "v1")
    CalibrationStore(settings.calibrations_dir).save(cal)
    measure, ran = run_prompts, list[Level]()

    def interrupted(engine: Any, level: Level, *args: Any, **kwargs: Any) -> Any:
        if level is Level.BALANCED:
            raise KeyboardInterrupt
        ran.append(level)
        return measure(engine, level, *args, **kwargs)

    monkeypatch.setattr(baseline, "run_prompts", interrupted)
    with pytest.raises(KeyboardInterrupt):
        baseline.attach(settings, engine.lm, [cal])
    kept = sorted(baseline.progress_dir(settings).glob("*.json"))
    assert [p.name.split("-")[0] for p in kept] == ["dense"]
    dense = json.loads(kept[0].read_text())

    def counted(engine: Any, level: Level, *args: Any, **kwargs: Any) -> Any:
        ran.append(level)
        return measure(engine, level, *args, **kwargs)

    monkeypatch.setattr(baseline, "run_prompts", counted)
    sent = baseline.attach(settings, engine.lm, [cal])
    assert ran == [Level.DENSE, Level.BALANCED], "the dense level was measured once"
    assert sent == 2 * len(PROMPTS)
    assert cal.dense_baseline is not None and cal.baseline is not None
    assert cal.dense_baseline == dense, "the kept dense level is the one attached"
    assert cal.baseline["requests"] == len(PROMPTS)
    assert list(baseline.progress_dir(settings).glob("*.json")) == []
    baseline.attach(settings, engine.lm, [cal])
    assert ran[2:] == [Level.DENSE, Level.BALANCED], "after a whole pass, nothing is kept"


def test_the_baseline_pass_measures_drift_on_its_share(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPARSEGUARD_ENGINE__BASELINE_MAX_NEW_TOKENS", "3")
    monkeypatch.setenv("SPARSEGUARD_ENGINE__BASELINE_DRIFT_SHARE", "0.5")
    prompts = [
        Prompt(kind, f"Say something about {kind} number {i}.")
        for kind in ("chat", "code")
        for i in range(4)
    ]
    monkeypatch.setattr(baseline, "baseline_prompts", lambda settings: prompts)
    settings = Settings(home=tmp_path)
    engine = tiny_engine()
    cal = calibration_of(engine, "v1")
    CalibrationStore(settings.calibrations_dir).save(cal)
    baseline.attach(settings, engine.lm, [cal])
    assert cal.baseline is not None and cal.dense_baseline is not None
    drift = cal.baseline["signals"]["semantic_drift_kl"]
    assert cal.baseline["requests"] == 8 and drift["n"] == 4, "half of each kind's requests"
    assert {k: len(v) for k, v in drift["kind_values"].items()} == {"chat": 2, "code": 2}
    assert "semantic_drift_kl" not in cal.dense_baseline["signals"]
