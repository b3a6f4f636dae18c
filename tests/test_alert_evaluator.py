"""The pure alert state machine: pending, firing, resolved, repeats, no data, grouping."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from alerts.definitions import Relative, Rule
from alerts.evaluator import (
    EvalState,
    Sample,
    Transition,
    evaluate,
    fingerprint,
    group,
    pipeline_sample,
    samples_from_windows,
)
from alerts.rules import DEFAULT_RULES, load_rules
from services.aggregator import windows
from services.aggregator.synthetic import synthetic_events
from services.config import SignalSettings

T0 = datetime(2025, 1, 1, tzinfo=UTC)
THRESHOLDS = SignalSettings().as_thresholds()
REPEAT_S = 3600.0
CACHE_LOW = Rule(
    name="CacheLow",
    metric="cache_hit_rate_mean",
    window="5m",
    op="<",
    threshold=0.7,
    for_s=60,
)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def sample(value: float | None, requests: float = 100, **labels: str) -> Sample:
    return Sample(
        labels={"model": "m", "level": "balanced", "window": "5m", **labels},
        values={"cache_hit_rate_mean": value, "requests": requests},
    )


def run(
    rules: Sequence[Rule],
    steps: Sequence[tuple[float, list[Sample]]],
    state: EvalState | None = None,
) -> tuple[EvalState, list[Transition]]:
    """Evaluate at each (seconds, samples) step; all transitions in order."""
    state = state or EvalState()
    out: list[Transition] = []
    for seconds, samples in steps:
        state, transitions = evaluate(state, rules, samples, at(seconds), REPEAT_S)
        out.extend(transitions)
    return state, out


def summary(transitions: list[Transition]) -> list[tuple[float, str, bool]]:
    return [((t.at - T0).total_seconds(), t.state, t.notify) for t in transitions]


def default_rule(name: str, **changes: object) -> Rule:
    rule = next(r for r in load_rules(DEFAULT_RULES, THRESHOLDS) if r.name == name)
    return dataclasses.replace(rule, **changes)  # type: ignore[arg-type]


def test_pending_then_firing_after_for() -> None:
    steps = [(0, [sample(0.5)]), (30, [sample(0.4)]), (60, [sample(0.3)]), (90, [sample(0.3)])]
    state, transitions = run([CACHE_LOW], steps)
    assert summary(transitions) == [(0, "pending", False), (60, "firing", True)]
    firing = transitions[1]
    assert firing.value == 0.3 and firing.active_since == T0 and firing.rule == CACHE_LOW
    assert firing.labels == {
        "model": "m",
        "level": "balanced",
        "window": "5m",
        "alertname": "CacheLow",
        "severity": "warning",
    }
    [alert] = state.alerts.values()
    assert (alert.state, alert.last_value, alert.last_notified_at) == ("firing", 0.3, at(60))


def test_for_zero_fires_at_once() -> None:
    rule = dataclasses.replace(CACHE_LOW, for_s=0)
    _, transitions = run([rule], [(0, [sample(0.5)])])
    assert summary(transitions) == [(0, "firing", True)]


def test_firing_alert_resolves_when_the_condition_clears() -> None:
    steps = [(0, [sample(0.5)]), (60, [sample(0.5)]), (120, [sample(0.9)]), (180, [sample(0.9)])]
    state, transitions = run([CACHE_LOW], steps)
    assert summary(transitions)[-1] == (120, "resolved", True)
    assert transitions[-1].value == 0.9 and transitions[-1].active_since == T0
    assert state.alerts == {}


def test_pending_that_clears_vanishes_without_notification() -> None:
    state, transitions = run([CACHE_LOW], [(0, [sample(0.5)]), (30, [sample(0.9)])])
    assert summary(transitions) == [(0, "pending", False)]
    assert state.alerts == {}


def test_firing_is_repeated_after_the_repeat_interval() -> None:
    steps = [(s, [sample(0.5)]) for s in range(0, 2 * 3600 + 120, 60)]
    _, transitions = run([CACHE_LOW], steps)
    notified = [s for s, state, notify in summary(transitions) if notify]
    assert notified == [60, 60 + REPEAT_S, 60 + 2 * REPEAT_S]


def test_fingerprint_is_stable() -> None:
    labels = {"model": "m", "alertname": "CacheLow", "level": "balanced"}
    key = fingerprint("CacheLow", labels)
    assert key == fingerprint("CacheLow", dict(reversed(list(labels.items()))))
    assert key == "515b82ed8d9c85cf"  # pinned: stored alerts and receivers rely on it
    assert fingerprint("Other", labels) != key
    assert fingerprint("CacheLow", {**labels, "level": "dense"}) != key


def test_the_same_alert_twice_in_one_evaluation_is_one() -> None:
    rule = dataclasses.replace(CACHE_LOW, for_s=0)
    state, transitions = run([rule], [(0, [sample(0.5), sample(0.4), sample(0.5, level="x")])])
    assert [t.labels["level"] for t in transitions] == ["balanced", "x"]
    assert transitions[0].value == 0.5  # the first sample wins
    assert len(state.alerts) == 2


def test_group_by_label_values() -> None:
    rules = [dataclasses.replace(CACHE_LOW, for_s=0), dataclasses.replace(CACHE_LOW, name="B")]
    steps = [(60, [sample(0.5), sample(0.5, model="n"), pipeline_sample("spool_bytes", 1)])]
    _, transitions = run(rules, steps)
    groups = group([t for t in transitions if t.notify], ["alertname", "model"])
    assert {key: len(items) for key, items in groups.items()} == {
        ("CacheLow", "m"): 1,
        ("CacheLow", "n"): 1,
    }
    assert list(group(transitions, ["partition"])) == [("",)]


@pytest.mark.parametrize("gap", [None, float("nan")])
def test_missing_values_neither_fire_nor_resolve(gap: float | None) -> None:
    state, transitions = run([CACHE_LOW], [(0, [sample(gap)]), (60, [sample(gap)])])
    assert transitions == [] and state.alerts == {}
    steps = [(0, [sample(0.5)]), (60, [sample(0.5)]), (120, [sample(gap)]), (180, [])]
    state, transitions = run([CACHE_LOW], steps)
    assert summary(transitions) == [(0, "pending", False), (60, "firing", True)]
    [alert] = state.alerts.values()
    assert alert.state == "firing" and alert.last_seen == at(60)
    pending, _ = run([CACHE_LOW], [(0, [sample(0.5)]), (30, [sample(gap)])])
    _, later = run([CACHE_LOW], [(90, [sample(0.5)])], pending)
    assert summary(later) == [(90, "firing", True)]  # still active since 0


def test_too_few_requests_is_no_data() -> None:
    rule = dataclasses.replace(CACHE_LOW, min_requests=20)
    steps = [(0, [sample(0.5)]), (60, [sample(0.5)]), (120, [sample(0.9, requests=3)])]
    state, transitions = run([rule], steps)
    assert [t.state for t in transitions] == ["pending", "firing"]
    assert len(state.alerts) == 1
    _, quiet = run([rule], [(0, [sample(0.1, requests=19)])])
    assert quiet == []


def sparsity(value: float, target: float | None) -> Sample:
    return Sample(
        labels={"model": "m", "level": "balanced", "window": "5m"},
        values={"sparsity_mean": value, "sparsity_target": target, "requests": 100},
    )


@pytest.mark.parametrize(
    ("value", "target", "fires"),
    [(0.65, 0.7, True), (0.75, 0.7, False), (0.65, None, False), (0.55, None, True)],
)
def test_relative_threshold_uses_the_target_else_the_default(
    value: float, target: float | None, fires: bool
) -> None:
    rule = Rule(
        "SparsityBelowTarget",
        "sparsity_mean",
        "5m",
        "<",
        Relative("sparsity_target", 1.0, 0.6),
        min_requests=20,
    )
    _, transitions = run([rule], [(0, [sparsity(value, target)])])
    assert [t.state for t in transitions] == (["firing"] if fires else [])


def test_relative_threshold_without_default_needs_its_base() -> None:
    rule = dataclasses.replace(
        CACHE_LOW, metric="sparsity_mean", threshold=Relative("sparsity_target", 0.9), for_s=0
    )
    _, none = run([rule], [(0, [sparsity(0.1, None)])])
    _, fired = run([rule], [(0, [sparsity(0.62, 0.7)])])
    assert none == [] and [t.state for t in fired] == ["firing"]


def test_outside_band() -> None:
    rule = dataclasses.replace(
        CACHE_LOW, op="outside", threshold=(0.75, 0.92), for_s=0, metric="cache_hit_rate_mean"
    )
    for value, fires in [(0.7, True), (0.95, True), (0.75, False), (0.92, False)]:
        _, transitions = run([rule], [(0, [sample(value)])])
        assert bool(transitions) is fires, value


def test_pipeline_rules_read_pipeline_samples_only() -> None:
    rule = default_rule("TelemetryPipelineLag")
    lag = pipeline_sample("consumer_lag_events", 5000, partition="0")
    steps = [(0, [sample(0.1), lag]), (120, [lag])]
    _, transitions = run([rule], steps)
    assert summary(transitions) == [(0, "pending", False), (120, "firing", True)]
    assert transitions[-1].labels["partition"] == "0"
    with pytest.raises(ValueError, match="unknown pipeline metric"):
        pipeline_sample("lag", 1)


def test_stale_and_orphaned_alerts_are_retired() -> None:
    rule = dataclasses.replace(CACHE_LOW, for_s=0)
    state, _ = run([rule], [(0, [sample(0.5)])])
    kept, none = evaluate(state, [rule], [], at(600), REPEAT_S, stale_after_s=900)
    assert none == [] and kept == state
    gone, resolved = evaluate(state, [rule], [], at(901), REPEAT_S, stale_after_s=900)
    assert gone.alerts == {} and [(t.state, t.notify) for t in resolved] == [("resolved", True)]
    relabelled = dataclasses.replace(rule, labels={"team": "x"})
    _, removed = evaluate(state, [relabelled], [], at(60), REPEAT_S)
    assert [t.state for t in removed] == ["resolved"]
    retuned = dataclasses.replace(rule, threshold=0.6)
    kept, none = evaluate(state, [retuned], [], at(60), REPEAT_S)
    assert none == [] and len(kept.alerts) == 1


def test_invalid_calls_are_refused() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        evaluate(EvalState(), [CACHE_LOW], [], datetime(2025, 1, 1), REPEAT_S)
    with pytest.raises(ValueError, match="unique"):
        evaluate(EvalState(), [CACHE_LOW, CACHE_LOW], [], T0, REPEAT_S)
    with pytest.raises(ValueError, match="repeat_interval_s"):
        evaluate(EvalState(), [CACHE_LOW], [], T0, 0)


def test_samples_from_real_windows_drive_the_default_rules() -> None:
    state = windows.apply(windows.new_state(), synthetic_events(2000))
    snapshot = windows.snapshot(state, at(100), targets={"cal-1": 0.9})
    samples = samples_from_windows(snapshot)
    assert len(samples) == 4 * 3
    first = samples[0]
    assert set(first.labels) == {"model", "level", "window"}
    assert first.values["sparsity_target"] == 0.9
    assert (
        first.values["requests"]
        == snapshot[("synthetic-model", first.labels["level"])][first.labels["window"]].requests
    )
    rules = [dataclasses.replace(r, for_s=0) for r in load_rules(DEFAULT_RULES, THRESHOLDS)]
    _, transitions = evaluate(EvalState(), rules, samples, at(100), REPEAT_S)
    fired = {(t.rule.name, t.labels["window"]) for t in transitions}
    # synthetic sparsity is 0.4-0.7, far below a 0.9 target
    assert ("SparsityBelowTarget", "5m") in fired
    assert all(window == t.rule.window for t in transitions for window in [t.labels["window"]])


values = st.one_of(st.none(), st.floats(0, 1), st.just(0.7), st.just(float("nan")))
# Short steps, and long ones that reach the repeat interval and its boundary.
gaps = st.one_of(st.integers(1, 400), st.sampled_from([1800, 3599, 3600, 3601]))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(gaps, values, values), min_size=1, max_size=40),
    st.sampled_from([0.0, 30.0, 300.0]),
)
def test_evaluation_matches_a_model_of_the_state_machine_and_keeps_old_states(
    steps: list[tuple[int, float | None, float | None]], for_s: float
) -> None:
    """Two alerts of one rule against a plain model of the documented state machine; every
    state handed to `evaluate` is left as it was."""
    rule = dataclasses.replace(CACHE_LOW, for_s=for_s)
    model = {"balanced": _ModelAlert(), "x": _ModelAlert()}
    state = EvalState()
    now = 0.0
    for gap, first, second in steps:
        now += gap
        before = dict(state.alerts)
        readings = {"balanced": first, "x": second}
        samples = [sample(value, level=level) for level, value in readings.items()]
        new_state, transitions = evaluate(state, [rule], samples, at(now), REPEAT_S)
        assert dict(state.alerts) == before
        got = [
            (t.labels["level"], t.state, t.notify, t.value, (t.active_since - T0).total_seconds())
            for t in transitions
        ]
        expected = [
            (level, *change)
            for level, value in readings.items()
            if (change := model[level].step(value, now, for_s)) is not None
        ]
        assert got == expected, now
        state = new_state


@dataclasses.dataclass
class _ModelAlert:
    """CACHE_LOW (`value < 0.7`) for one label set, as the evaluator's docstring states it."""

    state: str | None = None  # None, "pending" or "firing"
    since: float = 0.0
    notified: float = 0.0

    def step(
        self, value: float | None, now: float, for_s: float
    ) -> tuple[str, bool, float, float] | None:
        """(state, notify, value, active since) of the transition at `now`, or None."""
        if value is None or math.isnan(value):
            return None  # no data: nothing changes
        if value >= 0.7:
            was, self.state = self.state, None
            return ("resolved", True, value, self.since) if was == "firing" else None
        if self.state is None:
            self.state, self.since = "pending", now
            if for_s > 0:
                return ("pending", False, value, self.since)
        if self.state == "pending" and now - self.since < for_s:
            return None
        if self.state == "firing" and now - self.notified < REPEAT_S:
            return None
        self.state, self.notified = "firing", now
        return ("firing", True, value, self.since)


@settings(max_examples=200, deadline=None)
@given(
    for_s=st.integers(0, 900),
    repeat_s=st.integers(60, 7200),
    gaps=st.lists(st.integers(1, 120), min_size=1, max_size=200),
)
def test_a_condition_that_holds_fires_once_per_repeat_interval(
    for_s: int, repeat_s: int, gaps: list[int]
) -> None:
    rule = dataclasses.replace(CACHE_LOW, for_s=for_s)
    state = EvalState()
    notified: list[datetime] = []
    now = T0
    for gap in [0, *gaps]:
        now += timedelta(seconds=gap)
        state, transitions = evaluate(state, [rule], [sample(0.1)], now, repeat_s)
        notified += [t.at for t in transitions if t.notify and t.state == "firing"]
    elapsed = (now - T0).total_seconds()
    if elapsed < for_s:
        assert notified == []
        return
    first = notified[0]
    assert (first - T0).total_seconds() >= for_s
    assert [t for t in notified if t < first + timedelta(seconds=repeat_s)] == [first]
    assert all((b - a).total_seconds() >= repeat_s for a, b in itertools.pairwise(notified))
