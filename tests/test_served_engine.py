"""Every process that runs the model builds it with `build_engine`, so the golden check and
the CLI measure the decode path the gateway serves (fast path and weight type from settings)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery
from fastapi.testclient import TestClient

from services.config import Settings
from services.gateway.app import create_app
from services.shared.engine import build_engine
from services.storage.db import make_engine, session_factory, upgrade
from services.workers.app import make_celery
from services.workers.drift import golden_check
from services.workers.jobs import ClaimedJob
from sparse_engine.calibration.store import CalibrationStore
from sparse_engine.model.model_dir import weights_sha256
from sparse_engine.runtime.engine import Engine
from tests.tiny import calibration_of, tiny_engine, tiny_model


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """A tiny Llama saved as a model directory, calibrated at balanced, and served with int8
    fast-path weights, configured as an operator would: through the environment."""
    model_dir = tmp_path / "tiny-llama"
    lm = tiny_model("llama")
    lm.model.save_pretrained(model_dir)
    lm.tokenizer.save_pretrained(model_dir)
    golden = tmp_path / "golden.jsonl"
    rows = [{"id": i, "prompt": f"Say {word}.", "reference": word} for i, word in enumerate("ab")]
    golden.write_text("".join(json.dumps(row) + "\n" for row in rows))
    for name, value in {
        "HOME": str(tmp_path / "home"),
        "ENGINE__MODEL": str(model_dir),
        "ENGINE__FAST_PATH": "int8",
        "TELEMETRY__ENABLED": "false",
        "JOBS__GOLDEN_SET": str(golden),
        "JOBS__GOLDEN_LEVELS": '["balanced"]',
        "JOBS__GOLDEN_MAX_NEW_TOKENS": "4",
    }.items():
        monkeypatch.setenv(f"SPARSEGUARD_{name}", value)
    settings = Settings()
    cal = calibration_of(tiny_engine(cache=False), "tiny-balanced-v1", weights_sha256(model_dir))
    CalibrationStore(settings.calibrations_dir).save(cal)
    return settings


@pytest.fixture
def celery(served: Settings) -> Iterator[Celery]:
    app = make_celery(served)
    yield app
    app.close()


def fast_dtype(engine: Engine) -> str:
    return engine.fast.dtype if engine.fast is not None else "off"


def test_the_golden_check_decodes_on_the_path_the_gateway_serves(
    served: Settings, celery: Celery
) -> None:
    with TestClient(create_app(served)) as client:
        gateway_engine: Engine = client.app.state.runtime.engine  # type: ignore[attr-defined]
    assert fast_dtype(gateway_engine) == "int8"
    upgrade(served.database_url)
    db = make_engine(served.database_url)
    job = ClaimedJob(1, "golden_check", "schedule", {}, 1)
    figures = golden_check(served, session_factory(db), celery, job)
    assert figures["fast_path"] == fast_dtype(gateway_engine)
    assert list(figures["levels"]) == ["balanced"]
    db.dispose()


def test_the_reference_path_is_asked_for_by_name(served: Settings) -> None:
    assert fast_dtype(build_engine(served)) == "int8"
    assert build_engine(served, fast=False).fast is None
    off = served.model_copy(
        update={"engine": served.engine.model_copy(update={"fast_path": "off"})}
    )
    assert build_engine(off).fast is None
