"""Which cells of the status page's window table are marked: a window whose alert rule's
condition holds now (the same test against the key's baseline as the alert, without `for`),
so the page turns red exactly where an alert is pending or firing."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from alerts.conditions import applies, observe
from alerts.definitions import BASELINE_PARTS, WINDOW_METRICS, Rule
from alerts.samples import Sample


def window_marks(
    labels: Mapping[str, str], data: Mapping[str, Any], rules: Sequence[Rule]
) -> dict[str, str]:
    """Metric -> "bad" for each window rule whose condition holds on this stored window."""
    values: dict[str, float | None] = {name: _number(data.get(name)) for name in WINDOW_METRICS}
    for name, ref in (data.get("references") or {}).items():
        for part in BASELINE_PARTS:
            values[f"baseline_{name}_{part}"] = _number(ref.get(part))
    sample = Sample(labels=dict(labels), values=values)
    return {
        rule.metric: "bad"
        for rule in rules
        if applies(rule, sample) and observe(rule, sample).holds
    }


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
