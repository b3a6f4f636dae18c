"""Shared test fixtures."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

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
    """A balanced calibration of SmolLM2 on Wikipedia, in a store private to the session.
    Computing it takes about 2 minutes on 2 cores, so it is kept in the shared cache under a
    key of everything that decides it: the weights, the configuration, torch's version and
    every file of `sparse_engine` (any change to the engine's code computes it afresh)."""
    store = CalibrationStore(tmp_path_factory.mktemp("calibrations"))
    cached = home / "test-calibrations" / _calibration_key(smollm)
    if not cached.is_dir():
        texts = load_texts("wiki", home)
        data = prepare_data(smollm.tokenizer, texts, CI_CALIBRATION, "wiki")
        fresh = CalibrationStore(tmp_path_factory.mktemp("fresh-calibrations"))
        for cal in calibrate(smollm, data, [Level.BALANCED], CI_CALIBRATION):
            fresh.save(cal)
        cached.parent.mkdir(parents=True, exist_ok=True)
        staged = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
        shutil.copytree(fresh.root, staged)
        try:
            staged.rename(cached)  # atomic; another run that got there first wins
        except OSError:
            shutil.rmtree(staged)
    for cal in CalibrationStore(cached).list():
        store.save(cal)
    return store


def _calibration_key(lm: LoadedModel) -> str:
    digest = hashlib.sha256(f"{lm.weights_sha256} {CI_CALIBRATION} {torch.__version__}".encode())
    engine = Path(__file__).resolve().parents[1] / "sparse_engine"
    for path in sorted(engine.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(engine)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:24]


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
