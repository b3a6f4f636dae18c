"""Baselines that arrive after their calibration (the first serve's baseline job): the
gateway's baseline book reads a version without one again after RECHECK_S and keeps one that
has it; the job finds the served calibrations that lack one. The job on a worker, through
`sparseguard up`: tests/test_up.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.config import Settings
from services.gateway import reasons
from services.gateway.reasons import BaselineBook
from services.workers.baseline_job import missing_baselines
from sparse_engine.calibration.store import CalibrationStore
from tests.baseline_fixtures import healthy_level
from tests.tiny import calibration_of, tiny_engine


def test_a_baseline_measured_later_is_read_once_it_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CalibrationStore(tmp_path)
    cal = calibration_of(tiny_engine(), "v1")
    store.save(cal)
    book = BaselineBook(store)
    assert book.lookup("v1", "balanced") is None  # published numbers until it is measured
    cal.baseline = healthy_level().to_dict()
    store.save(cal)
    assert book.lookup("v1", "balanced") is None, "read again only after RECHECK_S"
    monkeypatch.setattr(reasons, "RECHECK_S", 0.0)
    found = book.lookup("v1", "balanced")
    assert found is not None and found.to_dict() == healthy_level().to_dict()
    (tmp_path / "v1.json").unlink()  # once it has one, the book keeps it
    assert book.lookup("v1", "balanced") is not None


def test_the_job_measures_only_the_latest_calibrations_without_one(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path)
    store = CalibrationStore(settings.calibrations_dir)
    engine = tiny_engine()
    old, new = calibration_of(engine, "v1"), calibration_of(engine, "v2")
    new.created_at = "2999-01-01T00:00:00+00:00"  # the later one is served
    store.save(old)
    store.save(new)
    assert [c.version for c in missing_baselines(settings, engine.lm.weights_sha256)] == ["v2"]
    new.baseline = healthy_level().to_dict()
    store.save(new)
    assert missing_baselines(settings, engine.lm.weights_sha256) == []
    assert missing_baselines(settings, "other weights") == []
