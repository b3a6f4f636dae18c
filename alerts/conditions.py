"""How one rule reads one sample: whether it applies, the alert's labels and fingerprint, and
the observed value with whether the condition holds (None: no data)."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass

from alerts.definitions import Rule
from alerts.samples import Sample


@dataclass(frozen=True, slots=True)
class RuleReading:
    value: float | None
    holds: bool | None  # None: no data (missing value, too few requests, no relative bound)


def applies(rule: Rule, sample: Sample) -> bool:
    """A window rule reads samples of its window, a pipeline rule samples without one."""
    return rule.metric in sample.values and sample.labels.get("window") == rule.window


def alert_labels(rule: Rule, sample_labels: Mapping[str, str]) -> dict[str, str]:
    """As Prometheus builds them: the sample's labels, the rule's on top, then the name and
    severity."""
    return {**sample_labels, **rule.labels, "alertname": rule.name, "severity": rule.severity}


def fingerprint(rule_name: str, labels: Mapping[str, str]) -> str:
    """First 16 hex digits of the SHA-256 of the rule name and the sorted labels."""
    identity = json.dumps([rule_name, sorted(labels.items())], separators=(",", ":"))
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def observe(rule: Rule, sample: Sample) -> RuleReading:
    value = _finite(sample.values.get(rule.metric))
    if value is None:
        return RuleReading(None, None)
    if rule.window is not None and rule.min_requests > 0:
        requests = _finite(sample.values.get("requests"))
        if requests is None or requests < rule.min_requests:
            return RuleReading(value, None)
    finite = {name: _finite(v) for name, v in sample.values.items()}
    return RuleReading(value, rule.holds(value, finite))


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None
