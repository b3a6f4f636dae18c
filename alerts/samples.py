"""What the evaluator reads: `Sample`s, one per (model, level, window) from the aggregator's
window snapshot, plus pipeline samples built by whoever watches the pipeline."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from alerts.definitions import BASELINE_PARTS, PIPELINE_METRICS, WINDOW_METRICS


@dataclass(frozen=True, slots=True)
class Sample:
    """One labelled set of values; None (or a value that is not finite) means no data."""

    labels: dict[str, str]
    values: dict[str, float | None]


def samples_from_windows(
    snapshot: Mapping[tuple[str, str], Mapping[str, object]],
) -> list[Sample]:
    """One sample per (model, level, window) of a window snapshot (the aggregator's
    `WindowSummary` objects), with their numeric `WINDOW_METRICS` attributes and, from their
    `references` (name -> an object with `center`, `spread`, `tolerance`), the values a
    `Deviation` threshold reads (`baseline_<name>_<part>`)."""
    return [
        Sample(
            labels={"model": model, "level": level, "window": window},
            values={
                **{name: _number(getattr(summary, name)) for name in WINDOW_METRICS},
                **_reference_values(getattr(summary, "references", {})),
            },
        )
        for (model, level), by_window in snapshot.items()
        for window, summary in by_window.items()
    ]


def _reference_values(refs: Mapping[str, object]) -> dict[str, float | None]:
    return {
        f"baseline_{name}_{part}": _number(getattr(ref, part, None))
        for name, ref in refs.items()
        for part in BASELINE_PARTS
    }


def pipeline_sample(metric: str, value: float | None, **labels: str) -> Sample:
    """A sample of one pipeline metric, e.g. `pipeline_sample("consumer_lag_events", 12,
    partition="0")`."""
    if metric not in PIPELINE_METRICS:
        raise ValueError(
            f"unknown pipeline metric {metric!r}; one of {', '.join(PIPELINE_METRICS)}"
        )
    return Sample(labels=dict(labels), values={metric: _number(value)})


def _number(value: object) -> float | None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    return float(value) if math.isfinite(value) else None
