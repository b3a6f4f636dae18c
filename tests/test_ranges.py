"""`sparseguard calibrations ranges`: each level's healthy range per signal, read off the
baselines the calibrations store."""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

import pytest

from services.cli import main
from services.shared.ranges import healthy_ranges, ranges_table
from sparse_engine.calibration.store import CalibrationStore
from tests.baseline_fixtures import CALIBRATION, baseline_of, healthy_level

BASE = CALIBRATION


def test_each_level_reads_its_latest_calibrations_baseline_and_dense_the_newest() -> None:
    late = [0.5 + i / 1000 for i in range(200)]  # kinds k0 (even) and k1 (odd)
    dense = baseline_of({"late_silence": [0.1] * 200}).to_dict()
    earlier_dense = baseline_of({"late_silence": [0.2] * 200}).to_dict()
    cals = [
        dataclasses.replace(BASE, version="old", baseline=healthy_level().to_dict()),
        dataclasses.replace(  # baselined before "new": dense comes from "new"
            BASE,
            version="agg",
            level="aggressive",
            baseline=healthy_level().to_dict(),
            dense_baseline=earlier_dense,
            created_at="2099-01-01T00:00:00+00:00",  # the store's order decides, not a clock
        ),
        dataclasses.replace(
            BASE,
            version="new",
            baseline=baseline_of({"late_silence": late}).to_dict(),
            dense_baseline=dense,
        ),
        dataclasses.replace(BASE, version="cons", level="conservative"),  # no baseline
    ]
    found = healthy_ranges(cals)
    assert list(found) == ["dense", "balanced", "aggressive"]
    assert found["dense"]["calibration"] == "new"
    assert found["dense"]["signals"]["late_silence"]["median"] == pytest.approx(0.1)
    late_range = found["balanced"]["signals"]["late_silence"]
    assert found["balanced"]["calibration"] == "new" and late_range["n"] == 200
    assert late_range["median"] == pytest.approx(statistics.median(late))
    assert late_range["low"] == pytest.approx(0.5 + 1.99 / 1000, abs=1e-6)  # 1st percentile
    assert late_range["high"] == pytest.approx(0.5 + 197.01 / 1000, abs=1e-6)  # 99th
    assert late_range["kind_medians"] == {
        "k0": pytest.approx(statistics.median(late[0::2])),
        "k1": pytest.approx(statistics.median(late[1::2])),
    }
    table = ranges_table(found).splitlines()
    assert table[1] == "| signal | dense (200 req) | balanced (200 req) | aggressive (200 req) |"
    late_row = next(row for row in table if row.startswith("| late_silence |"))
    assert late_row.startswith("| late_silence | 0.1 (0.1-0.1) | 0.5995 (0.502-0.697) |")
    assert "| semantic_drift_kl | - | - | - |" in table  # a signal none of them measured
    assert healthy_ranges([BASE]) == {}


def test_the_command_names_the_fix_without_a_baseline_and_prints_the_ranges_with_one(
    cli_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["calibrations", "ranges"]) == 2
    err = capsys.readouterr().err
    assert "has a healthy baseline" in err and "sparseguard calibrate" in err
    assert "Traceback" not in err
    store = CalibrationStore(cli_home / "calibrations")
    (cal,) = store.list()
    cal.baseline = cal.dense_baseline = healthy_level().to_dict()
    store.save(cal)
    assert main(["calibrations", "ranges"]) == 0
    out = capsys.readouterr().out
    assert "| signal | dense (200 req) | balanced (200 req) |" in out
    assert cal.version in out
    assert main(["calibrations", "ranges", "--json"]) == 0
    assert '"late_silence"' in capsys.readouterr().out
