"""Judging alerts the way the SRE workbook does: per rule precision (the share of its alerts
that fired on a real fault), recall (the share of the faults meant for it that it caught),
detection time (fault start to firing) and reset time (fault end to resolved); per reason the
share of requests it fired on, with a 95 % Wilson interval."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from alerts.evaluator import Transition
from services.replay.replay import Scenario, seconds

GRACE_S = 600.0  # an alert resolving this long after a fault ended still belongs to it


@dataclass(frozen=True, slots=True)
class Firing:
    scenario: str
    rule: str
    level: str
    start_s: float
    end_s: float | None  # None: still firing when the replay ended


@dataclass(slots=True)
class FaultResult:
    fault: str
    level: str
    intended: str
    detected_s: float | None = None  # fault start -> the intended rule firing
    reset_s: float | None = None  # fault end -> the intended rule resolved
    also_fired: list[str] = field(default_factory=list)


def firings(scenario: Scenario, transitions: Sequence[Transition]) -> list[Firing]:
    """One firing per alert instance (repeat notifications folded in)."""
    open_: dict[str, Firing] = {}
    done: list[Firing] = []
    for t in transitions:
        if t.state == "firing" and t.fingerprint not in open_:
            start = seconds(t.at)
            open_[t.fingerprint] = Firing(
                scenario.name, t.rule.name, t.labels["level"], start, None
            )
        elif t.state == "resolved" and t.fingerprint in open_:
            f = open_.pop(t.fingerprint)
            done.append(Firing(f.scenario, f.rule, f.level, f.start_s, seconds(t.at)))
    return done + list(open_.values())


def is_true(scenario: Scenario, firing: Firing) -> bool:
    """A firing on the faulty level while the fault lasted (or in the grace after it)."""
    return (
        scenario.fault is not None
        and firing.level == scenario.fault_level
        and scenario.fault_start_s <= firing.start_s < scenario.fault_end_s + GRACE_S
    )


def fault_result(scenario: Scenario, intended: str, found: Sequence[Firing]) -> FaultResult:
    assert scenario.fault is not None and scenario.fault_level is not None
    result = FaultResult(scenario.fault, scenario.fault_level, intended)
    for f in found:
        if not is_true(scenario, f):
            continue
        if f.rule == intended and result.detected_s is None:
            result.detected_s = f.start_s - scenario.fault_start_s
            if f.end_s is not None:
                result.reset_s = f.end_s - scenario.fault_end_s
        elif f.rule != intended and f.rule not in result.also_fired:
            result.also_fired.append(f.rule)
    return result


@dataclass(frozen=True, slots=True)
class RuleScore:
    rule: str
    firings: int
    true_firings: int
    intended_faults: int
    detected_faults: int
    median_detection_s: float | None
    median_reset_s: float | None

    @property
    def precision(self) -> float | None:
        return self.true_firings / self.firings if self.firings else None

    @property
    def recall(self) -> float | None:
        return self.detected_faults / self.intended_faults if self.intended_faults else None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "precision": self.precision, "recall": self.recall}


def rule_scores(
    rules: Sequence[str],
    runs: Mapping[str, tuple[Scenario, list[Firing]]],
    faults: Sequence[FaultResult],
) -> list[RuleScore]:
    scores = []
    for rule in rules:
        mine = [(s, f) for s, fs in runs.values() for f in fs if f.rule == rule]
        meant = [r for r in faults if r.intended == rule]
        detected = [r for r in meant if r.detected_s is not None]
        resets = [r.reset_s for r in detected if r.reset_s is not None]
        scores.append(
            RuleScore(
                rule=rule,
                firings=len(mine),
                true_firings=sum(is_true(s, f) for s, f in mine),
                intended_faults=len(meant),
                detected_faults=len(detected),
                median_detection_s=_median([r.detected_s for r in detected if r.detected_s]),
                median_reset_s=_median(resets),
            )
        )
    return scores


@dataclass(frozen=True, slots=True)
class Rate:
    hits: int
    n: int

    @property
    def share(self) -> float:
        return self.hits / self.n if self.n else 0.0

    def interval(self, z: float = 1.96) -> tuple[float, float]:
        """Wilson score interval."""
        if not self.n:
            return 0.0, 1.0
        p, n = self.share, self.n
        centre = (p + z * z / (2 * n)) / (1 + z * z / n)
        half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
        return max(0.0, centre - half), min(1.0, centre + half)

    def to_dict(self) -> dict[str, Any]:
        low, high = self.interval()
        return {"hits": self.hits, "n": self.n, "share": self.share, "ci95": [low, high]}


def _median(values: Sequence[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
