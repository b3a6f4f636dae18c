"""Alert rule files: the packaged defaults, and every kind of mistake reported with its line."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from alerts.definitions import WINDOW_METRICS, Deviation
from alerts.durations import format_duration, parse_duration
from alerts.rules import DEFAULT_RULES, Rule, RuleError, load_rules, parse_rules
from alerts.templates import render_all
from services.aggregator.summary import WindowSummary
from services.config import SignalSettings

THRESHOLDS = SignalSettings().as_thresholds()
VALID = """\
rules:
  - name: CacheLow
    metric: cache_hit_rate_mean
    window: 5m
    op: "<"
    threshold: 0.7
    for: 5m
    annotations:
      summary: "low on {{ $labels.model }}"
"""


def by_name() -> dict[str, Rule]:
    return {rule.name: rule for rule in load_rules(DEFAULT_RULES, THRESHOLDS)}


def test_default_rules_cover_the_mission_alerts() -> None:
    assert list(by_name()) == [
        "SparsityBelowTarget",
        "GateConfidenceOutOfBand",
        "SemanticDriftHigh",
        "SilenceSpikes",
        "LateSilenceHigh",
        "SignalSpreadCollapsed",
        "LayerSparsityShift",
        "PrefixCacheHitRateLow",
        "GateDegraded",
        "TelemetryPipelineLag",
        "TelemetrySpoolGrowing",
        "GoldenCheckMissed",
        "GoldenDriftHigh",
    ]
    for rule in by_name().values():
        assert rule.annotations.keys() == {"summary", "description"}, rule.name
        assert "webhook" in rule.actions


def test_default_thresholds_come_from_the_signal_settings() -> None:
    # Values unlike any default: each rule must take its threshold from the settings it is
    # given, not from a number written in the rules file. Window rules test against the
    # baseline with alert_z standard errors (the published numbers are the references'
    # fallback: tests/test_baselines.py).
    signals = SignalSettings(alert_z=2.7)
    rules = {r.name: r for r in load_rules(DEFAULT_RULES, signals.as_thresholds())}
    sparsity = rules["SparsityBelowTarget"]
    assert (sparsity.window, sparsity.op, sparsity.for_s) == ("5m", "<", 300)
    assert sparsity.threshold == Deviation("sparsity", 2.7)
    assert sparsity.actions == ("webhook", "recalibrate")
    assert rules["GateConfidenceOutOfBand"].threshold == Deviation("gate_confidence", 2.7)
    assert rules["GateConfidenceOutOfBand"].op == "outside"
    drift = rules["SemanticDriftHigh"]
    assert (drift.window, drift.threshold) == ("24h", Deviation("drift_kl", 2.7, "drift_samples"))
    assert drift.actions == ("webhook", "recalibrate", "flag_finetune")
    assert rules["PrefixCacheHitRateLow"].threshold == Deviation("cache_hit", 2.7)
    assert rules["GateDegraded"].threshold == Deviation("gate_entropy", 2.7)
    assert rules["SilenceSpikes"].threshold == Deviation("silence_spike", 2.7)
    lag = rules["TelemetryPipelineLag"]
    assert (lag.window, lag.threshold, lag.for_s) == (None, 1000, 120)
    assert rules["TelemetrySpoolGrowing"].for_s == 300
    assert rules["GoldenCheckMissed"].threshold == 26 * 3600


def test_deviation_threshold_errors_name_the_fix() -> None:
    def parse(threshold: str) -> None:
        parse_rules(rule_with(threshold=f"threshold: {threshold}"), "r.yaml", {"z": 3.0})

    with pytest.raises(RuleError, match="unknown baseline 'nope'"):
        parse("{baseline: nope, z: 3}")
    with pytest.raises(RuleError, match="missing field 'z'"):
        parse("{baseline: sparsity}")
    with pytest.raises(RuleError, match="'z' must be >= 0"):
        parse("{baseline: sparsity, z: -1}")
    with pytest.raises(RuleError, match="unknown count metric 'nope'"):
        parse("{baseline: sparsity, z: 3, count: nope}")
    with pytest.raises(RuleError, match="unknown key 'extra'"):
        parse("{baseline: sparsity, z: 3, extra: 1}")
    rule = parse_rules(
        rule_with(threshold="threshold: {baseline: sparsity, z: {signal: z}}"), "r.yaml", {"z": 3.0}
    )[0]
    assert rule.threshold == Deviation("sparsity", 3.0)


def test_window_metrics_are_numeric_window_summary_fields() -> None:
    types = {f.name: f.type for f in dataclasses.fields(WindowSummary)}
    for name in WINDOW_METRICS:
        assert types[name] in ("int", "float", "float | None"), name


def test_valid_file_and_defaults_for_optional_fields(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text(VALID)
    [rule] = load_rules(path)
    assert rule == Rule(
        name="CacheLow",
        metric="cache_hit_rate_mean",
        window="5m",
        op="<",
        threshold=0.7,
        min_requests=1,
        for_s=300,
        severity="warning",
        labels={},
        annotations={"summary": "low on {{ $labels.model }}"},
        actions=(),
    )


def test_annotations_render_like_prometheus() -> None:
    rule = by_name()["SparsityBelowTarget"]
    rendered = render_all(rule.annotations, {"model": "m", "level": "balanced"}, 0.65)
    assert rendered["summary"] == "Sparsity below target on m (balanced)"
    assert rendered["description"].startswith("5-minute mean sparsity is 0.650, significantly")
    lag = by_name()["TelemetryPipelineLag"]
    assert "5000 events" in render_all(lag.annotations, {}, 5000.0)["description"]


def rule_with(**changes: str) -> str:
    """VALID with one line replaced (key -> new text) or appended (key not present)."""
    lines = VALID.splitlines()
    for key, text in changes.items():
        found = [i for i, line in enumerate(lines) if line.lstrip(" -").startswith(f"{key}:")]
        if found:
            line = lines[found[0]]
            prefix = line[: len(line) - len(line.lstrip(" -"))]
            lines[found[0]] = prefix + text if text else ""
        else:
            lines.append(f"    {text}")
    return "\n".join(line for line in lines if line) + "\n"


SECOND = """\
  - name: CacheLow
    metric: requests
    window: 1h
    op: ">"
    threshold: 5
"""

INVALID = [
    ("unknown key", rule_with(treshold="treshold: 0.7"), 10, "unknown key 'treshold'"),
    ("unknown metric", rule_with(metric="metric: sparsity"), 3, "unknown metric 'sparsity'"),
    ("bad op", rule_with(op='op: "<="'), 5, "bad op '<='"),
    ("bad duration", rule_with(**{"for": "for: 5 minutes"}), 7, "bad duration '5 minutes'"),
    ("unit order", rule_with(**{"for": "for: 30m1h"}), 7, "largest first"),
    ("duration type", rule_with(**{"for": "for: 300"}), 7, "wrong type"),
    ("duplicate name", VALID + SECOND, 10, "duplicate rule name 'CacheLow'"),
    ("missing field", rule_with(threshold=""), 2, "missing field 'threshold'"),
    ("missing name", "rules:\n  - metric: requests\n", 2, "missing field 'name'"),
    ("missing window", rule_with(window=""), 2, "missing field 'window'"),
    ("threshold type", rule_with(threshold="threshold: high"), 6, "wrong type"),
    ("min_requests type", rule_with(min_requests="min_requests: many"), 10, "wrong type"),
    ("negative min_requests", rule_with(min_requests="min_requests: -1"), 10, ">= 0"),
    ("label value type", rule_with(labels="labels: {team: 1}"), 10, "wrong type"),
    ("reserved label", rule_with(labels="labels: {severity: x}"), 10, "bad label name"),
    ("band shape", rule_with(op="op: outside"), 6, "needs [low, high]"),
    ("band order", rule_with(op="op: outside", threshold="threshold: [0.9, 0.1]"), 6, "low"),
    ("bad window", rule_with(window="window: 10m"), 4, "bad window '10m'"),
    ("pipeline window", rule_with(metric="metric: spool_bytes"), 4, "has no window"),
    (
        "pipeline min_requests",
        rule_with(metric="metric: spool_bytes", window="", min_requests="min_requests: 2"),
        9,
        "window metrics only",
    ),
    ("bad severity", rule_with(severity="severity: page"), 10, "bad severity 'page'"),
    ("unknown action", rule_with(actions="actions: [webhook, pager]"), 10, "unknown action"),
    ("duplicate action", rule_with(actions="actions: [webhook, webhook]"), 10, "duplicate action"),
    (
        "relative_to",
        rule_with(threshold="threshold: {relative_to: target}"),
        6,
        "unknown metric 'target'",
    ),
    (
        "relative key",
        rule_with(threshold="threshold: {relative_to: sparsity_target, dflt: 1}"),
        6,
        "unknown key 'dflt'",
    ),
    ("placeholder", rule_with(summary='summary: "{{ .Value }}"'), 9, "unsupported placeholder"),
    ("duplicate key", rule_with(severity="op: '>'"), 10, "duplicate key 'op'"),
    ("yaml syntax", rule_with(severity="severity: [warning"), 11, "invalid YAML"),
    ("name type", rule_with(name="name: [a]"), 2, "wrong type"),
    ("bad name", rule_with(name="name: cache low"), 2, "bad rule name"),
    ("rules type", "rules: {a: 1}\n", 1, "wrong type for 'rules'"),
    ("top-level key", "rule: []\n", 1, "unknown key 'rule'"),
    ("missing rules", "{}\n", 1, "missing field 'rules'"),
    ("empty file", "", 1, "empty rules file"),
    ("nan", rule_with(threshold="threshold: .nan"), 6, "finite"),
]


@pytest.mark.parametrize(
    ("text", "line", "reason"), [case[1:] for case in INVALID], ids=[case[0] for case in INVALID]
)
def test_invalid_files_name_the_line_and_reason(text: str, line: int, reason: str) -> None:
    with pytest.raises(RuleError) as caught:
        parse_rules(text, "mine.yaml")
    message = str(caught.value)
    assert message.startswith(f"mine.yaml:{line}: "), message
    assert reason in message, message


def test_load_rules_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(rule_with(op="op: '=='"))
    with pytest.raises(ValueError, match=rf"^{path}:5: .*bad op"):
        load_rules(path)


@given(st.integers(min_value=0, max_value=10**9))
def test_durations_round_trip(milliseconds: int) -> None:
    seconds = milliseconds / 1000
    assert parse_duration(format_duration(seconds)) == pytest.approx(seconds)


def test_durations() -> None:
    assert parse_duration("1h30m") == 5400
    assert parse_duration("26h") == 93600
    assert format_duration(93600) == "1d2h"
    assert format_duration(0) == "0s"
    with pytest.raises(ValueError, match="bad duration"):
        parse_duration("5")
