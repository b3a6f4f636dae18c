"""What is normal for a model: each level's healthy range per signal, read off the baselines
the calibrations store (median and the 1st-99th percentile of the baseline pass's requests,
and each kind's median), for `sparseguard calibrations ranges` and the README's tables."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from sparse_engine.calibration.baseline import SIGNALS, LevelBaseline
from sparse_engine.calibration.store import Calibration
from sparse_engine.sparsity.plan import SPARSE_LEVELS, Level

LOW, HIGH = 1, 99  # the stored percentiles that bound a range


def healthy_ranges(cals: Sequence[Calibration]) -> dict[str, dict[str, Any]]:
    """Per level (dense first, from the newest of those baseline passes), per signal: n,
    median, low, high and each kind's median; levels whose latest calibration has no
    baseline are left out. `cals` oldest first, as the store lists them (the order in which
    `CalibrationStore.latest` picks what is served)."""
    latest = {c.level: c for c in cals}
    measured = [latest[lv.value] for lv in SPARSE_LEVELS if lv.value in latest]
    measured = [c for c in measured if c.baseline is not None]
    if not measured:
        return {}
    order = {c.version: i for i, c in enumerate(cals)}
    newest = max(measured, key=lambda c: order[c.version])
    out: dict[str, dict[str, Any]] = {}
    if newest.dense_baseline is not None:
        out[Level.DENSE.value] = _level(newest.dense_baseline, newest.version)
    for cal in measured:
        out[cal.level] = _level(cal.baseline or {}, cal.version)
    return out


def _level(data: dict[str, Any], version: str) -> dict[str, Any]:
    baseline = LevelBaseline.from_dict(data)
    signals = {}
    for name in SIGNALS:
        stats = baseline.get(name)
        if stats is None:
            continue
        signals[name] = {
            "n": stats.n,
            "median": stats.median,
            "low": stats.quantiles[LOW],
            "high": stats.quantiles[HIGH],
            "kind_medians": {
                k: statistics.median(vs) for k, vs in sorted(stats.kind_values.items())
            },
        }
    return {"calibration": version, "requests": baseline.requests, "signals": signals}


def ranges_table(ranges: dict[str, dict[str, Any]]) -> str:
    """A Markdown table: one row per signal, one column per level, `median (low-high)`."""
    levels = list(ranges)
    lines = [
        "healthy ranges: median (1st-99th percentile) of each level's baseline pass",
        "| signal | " + " | ".join(f"{lv} ({ranges[lv]['requests']} req)" for lv in levels) + " |",
        "|---|" + "---|" * len(levels),
    ]
    for name in SIGNALS:
        cells = []
        for lv in levels:
            stats = ranges[lv]["signals"].get(name)
            cells.append(
                "-"
                if stats is None
                else f"{stats['median']:.4g} ({stats['low']:.4g}-{stats['high']:.4g})"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append(
        "measured with: " + "; ".join(f"{lv} {ranges[lv]['calibration']}" for lv in levels)
    )
    return "\n".join(lines)
