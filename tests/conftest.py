"""Shared test fixtures."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.telemetry.broker import Broker
from sparse_engine.calibration.pipeline import CalibrationConfig, calibrate, prepare_data
from sparse_engine.calibration.store import CalibrationStore
from sparse_engine.data.corpora import load_texts
from sparse_engine.model.catalog import DEFAULT_MODEL, resolve_model
from sparse_engine.model.loader import LoadedModel, load_model
from sparse_engine.sparsity.plan import Level
from tests import service_fixtures

# Small enough for CI; `make run` and `make bench` calibrate with the full defaults.
CI_CALIBRATION = CalibrationConfig(samples=32, seq_len=256, heldout_tokens=2048)


@pytest.fixture(scope="session")
def home() -> Path:
    """The cache of real packages and models shared by slow tests across runs:
    $SPARSEGUARD_HOME if set, else ~/.cache/sparseguard (fetching them is slow)."""
    configured = os.environ.get("SPARSEGUARD_HOME")
    path = Path(configured).expanduser() if configured else Path.home() / ".cache" / "sparseguard"
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def smollm(home: Path) -> LoadedModel:
    """The real SmolLM2-135M-Instruct, loaded once per test session."""
    return load_model(resolve_model(DEFAULT_MODEL, home))


@pytest.fixture(scope="session")
def calibrated_store(
    smollm: LoadedModel, home: Path, tmp_path_factory: pytest.TempPathFactory
) -> CalibrationStore:
    """A balanced calibration of SmolLM2 on Wikipedia, in a store private to the session."""
    data = prepare_data(smollm.tokenizer, load_texts("wiki", home), CI_CALIBRATION, "wiki")
    store = CalibrationStore(tmp_path_factory.mktemp("calibrations"))
    for cal in calibrate(smollm, data, [Level.BALANCED], CI_CALIBRATION):
        store.save(cal)
    return store


@pytest.fixture
def cli_home(
    home: Path,
    calibrated_store: CalibrationStore,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Path:
    """A private SPARSEGUARD_HOME for in-process CLI runs: the shared model cache and a copy
    of the session's balanced calibration."""
    monkeypatch.setenv("SPARSEGUARD_HOME", str(tmp_path))
    monkeypatch.setenv("SPARSEGUARD_CACHE_DIR", str(home))
    shutil.copytree(calibrated_store.root, tmp_path / "calibrations")
    return tmp_path


@pytest.fixture
def kafka_broker() -> Iterator[Broker]:
    """A fresh Tansu broker (memory storage) on its own port, always stopped at the end."""
    broker = Broker()
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The test Redis server's URL; its tests skip without one, and fail under CI=true."""
    return service_fixtures.require_redis()
