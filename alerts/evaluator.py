"""The pure alert state machine, no I/O and no clock:
`evaluate(state, rules, samples, now, repeat_interval_s) -> (state, transitions)`.

Per alert (a rule and a sample's labels, identified by `fingerprint`):
- the condition holds: new -> "pending" (notify=False), then "firing" (notify=True) once it
  has held for the rule's `for_s` (0: at once); while firing, "firing" again with notify=True
  every `repeat_interval_s`;
- the condition clears: a firing alert is "resolved" (notify=True); a pending one vanishes;
- no data (value None or not finite, fewer than `min_requests`, no relative bound, or no
  sample at all): nothing changes, so a gap neither fires nor resolves an alert. With
  `stale_after_s`, an alert without data for longer than that is retired (resolved if firing);
- its rule is removed or changed so that it no longer yields this alert: retired likewise.

`group(transitions, group_by)` batches transitions into notifications by label values.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Literal

from alerts.conditions import RuleReading, alert_labels, applies, fingerprint, observe
from alerts.definitions import Rule
from alerts.samples import Sample, pipeline_sample, samples_from_windows

__all__ = [
    "ActiveAlert",
    "EvalState",
    "Sample",
    "Transition",
    "evaluate",
    "fingerprint",
    "group",
    "pipeline_sample",
    "samples_from_windows",
]

AlertState = Literal["pending", "firing"]
TransitionState = Literal["pending", "firing", "resolved"]


@dataclass(frozen=True, slots=True)
class ActiveAlert:
    rule: Rule
    sample_labels: dict[str, str]
    labels: dict[str, str]
    state: AlertState
    active_since: datetime
    last_value: float | None
    last_notified_at: datetime | None
    last_seen: datetime  # the last evaluation in which the condition had data


@dataclass(frozen=True, slots=True)
class EvalState:
    alerts: Mapping[str, ActiveAlert] = field(default_factory=dict)  # by fingerprint


@dataclass(frozen=True, slots=True)
class Transition:
    fingerprint: str
    rule: Rule
    labels: dict[str, str]
    state: TransitionState
    value: float | None
    at: datetime
    notify: bool
    active_since: datetime  # when the condition began to hold (a notification's startsAt)


def evaluate(
    state: EvalState,
    rules: Sequence[Rule],
    samples: Sequence[Sample],
    now: datetime,
    repeat_interval_s: float,
    *,
    stale_after_s: float | None = None,
) -> tuple[EvalState, list[Transition]]:
    """The next state and the transitions of this evaluation, in rule then sample order."""
    _check(rules, now, repeat_interval_s)
    alerts = dict(state.alerts)
    transitions: list[Transition] = []
    seen: set[str] = set()
    for rule in rules:
        for sample in samples:
            if not applies(rule, sample):
                continue
            candidate = _Candidate.of(rule, sample)
            if candidate.key in seen:  # the same alert from a duplicate sample
                continue
            seen.add(candidate.key)
            found = alerts.pop(candidate.key, None)
            alert, transition = _step(
                candidate, found, observe(rule, sample), now, repeat_interval_s
            )
            if alert is not None:
                alerts[candidate.key] = alert
            if transition is not None:
                transitions.append(transition)
    transitions.extend(_retire(alerts, rules, now, stale_after_s))
    return EvalState(alerts), transitions


def group(
    transitions: Iterable[Transition], group_by: Sequence[str]
) -> dict[tuple[str, ...], list[Transition]]:
    """Transitions by the values of the `group_by` labels ('' where a label is missing), in
    first-seen order; pass the ones to notify (`t.notify`) to batch notifications."""
    groups: dict[tuple[str, ...], list[Transition]] = {}
    for transition in transitions:
        key = tuple(transition.labels.get(name, "") for name in group_by)
        groups.setdefault(key, []).append(transition)
    return groups


def _check(rules: Sequence[Rule], now: datetime, repeat_interval_s: float) -> None:
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware (pass datetime.now(UTC))")
    if not repeat_interval_s > 0:
        raise ValueError(f"repeat_interval_s must be > 0, got {repeat_interval_s}")
    names = [rule.name for rule in rules]
    if len(set(names)) != len(names):
        raise ValueError("rule names must be unique")


@dataclass(frozen=True, slots=True)
class _Candidate:
    """An alert a rule could raise for one sample."""

    key: str
    rule: Rule
    sample_labels: dict[str, str]
    labels: dict[str, str]

    @classmethod
    def of(cls, rule: Rule, sample: Sample) -> _Candidate:
        labels = alert_labels(rule, sample.labels)
        return cls(fingerprint(rule.name, labels), rule, dict(sample.labels), labels)

    def start(self, value: float | None, now: datetime) -> ActiveAlert:
        return ActiveAlert(
            self.rule, self.sample_labels, self.labels, "pending", now, value, None, now
        )


def _step(
    candidate: _Candidate,
    alert: ActiveAlert | None,
    seen: RuleReading,
    now: datetime,
    repeat_s: float,
) -> tuple[ActiveAlert | None, Transition | None]:
    """The alert after one observation (None: none) and the transition it makes, if any."""
    key = candidate.key
    if seen.holds is None:
        return alert, None
    if not seen.holds:
        if alert is not None and alert.state == "firing":
            return None, _transition(key, alert, "resolved", seen.value, now, notify=True)
        return None, None
    if alert is None:
        alert = candidate.start(seen.value, now)
        if alert.rule.for_s > 0:
            return alert, _transition(key, alert, "pending", seen.value, now, notify=False)
    alert = replace(alert, rule=candidate.rule, last_value=seen.value, last_seen=now)
    if alert.state == "pending":
        if _elapsed(alert.active_since, now) < alert.rule.for_s:
            return alert, None
    elif alert.last_notified_at is not None and _elapsed(alert.last_notified_at, now) < repeat_s:
        return alert, None
    alert = replace(alert, state="firing", last_notified_at=now)
    return alert, _transition(key, alert, "firing", seen.value, now, notify=True)


def _retire(
    alerts: dict[str, ActiveAlert], rules: Sequence[Rule], now: datetime, stale_s: float | None
) -> list[Transition]:
    """Remove alerts whose rule no longer yields them or that have had no data for too long."""
    current = {rule.name: rule for rule in rules}
    transitions: list[Transition] = []
    for key, alert in list(alerts.items()):
        rule = current.get(alert.rule.name)
        orphaned = rule is None or not _yields(rule, alert, key)
        stale = stale_s is not None and _elapsed(alert.last_seen, now) > stale_s
        if orphaned or stale:
            del alerts[key]
            if alert.state == "firing":
                transitions.append(
                    _transition(key, alert, "resolved", alert.last_value, now, notify=True)
                )
    return transitions


def _yields(rule: Rule, alert: ActiveAlert, key: str) -> bool:
    same_window = alert.sample_labels.get("window") == rule.window
    return same_window and fingerprint(rule.name, alert_labels(rule, alert.sample_labels)) == key


def _transition(
    key: str,
    alert: ActiveAlert,
    state: TransitionState,
    value: float | None,
    at: datetime,
    notify: bool,
) -> Transition:
    return Transition(
        key, alert.rule, dict(alert.labels), state, value, at, notify, alert.active_since
    )


def _elapsed(since: datetime, now: datetime) -> float:
    return (now - since).total_seconds()
