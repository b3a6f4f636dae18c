"""The exported Prometheus rules: bound to the services' metric tables, deterministic, and
passing `promtool check rules` and the unit tests in alerts/promtool_tests.yaml."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import Counter, Histogram

from alerts.prometheus import (
    export_prometheus,
    metric_names,
    to_prometheus,
    unexported,
)
from alerts.rules import DEFAULT_RULES, load_rules
from services.aggregator.metrics import AGGREGATOR_METRICS, ALERT_SERIES
from services.cli import alerts as alerts_cli
from services.config import Settings, SignalSettings
from services.gateway.metrics import GATEWAY_METRICS
from services.shared.metrics_table import MetricSpec

PROMTOOL_TESTS = DEFAULT_RULES.with_name("promtool_tests.yaml")
PREFIX = "sparseguard_"
THRESHOLDS = SignalSettings().as_thresholds()


def exposed_names(spec: MetricSpec) -> set[str]:
    """The series names Prometheus scrapes for one table entry."""
    full = PREFIX + spec.name
    if spec.kind is Counter:
        return {full if full.endswith("_total") else full + "_total"}
    if spec.kind is Histogram:
        return {full + suffix for suffix in ("_bucket", "_sum", "_count")}
    return {full}


def table_names() -> set[str]:
    return {
        name for spec in (*AGGREGATOR_METRICS, *GATEWAY_METRICS) for name in exposed_names(spec)
    }


def exported() -> str:
    return export_prometheus(load_rules(DEFAULT_RULES, THRESHOLDS), ALERT_SERIES)


def test_every_metric_in_the_exported_rules_exists_in_the_metric_tables() -> None:
    rules = load_rules(DEFAULT_RULES, THRESHOLDS)
    expressions = [
        rule["expr"] for rule in to_prometheus(rules, ALERT_SERIES)["groups"][0]["rules"]
    ]
    named = {name for expr in expressions for name in re.findall(r"\bsparseguard_\w+", expr)}
    assert named == metric_names(rules, ALERT_SERIES)
    assert named - table_names() == set()
    assert "sparseguard_baseline_tolerance" in named
    assert "sparseguard_window_semantic_drift_samples" in named  # the drift rule's count
    assert "sparseguard_aggregator_consumer_lag_events" in named


def test_every_default_rule_is_exported() -> None:
    assert unexported(load_rules(DEFAULT_RULES, THRESHOLDS), ALERT_SERIES) == []
    assert "Not exported" not in exported()


def test_rules_without_a_prometheus_series_are_named_in_the_header() -> None:
    series = {k: v for k, v in ALERT_SERIES.items() if k != "golden_check_age_s"}
    rules = load_rules(DEFAULT_RULES, THRESHOLDS)
    assert [rule.name for rule in unexported(rules, series)] == ["GoldenCheckMissed"]
    text = export_prometheus(rules, series)
    assert "(no Prometheus series for 'golden_check_age_s' yet): GoldenCheckMissed" in text
    assert "alert: GoldenCheckMissed" not in text


def test_export_matches_the_rules() -> None:
    [group] = to_prometheus(load_rules(DEFAULT_RULES, THRESHOLDS), ALERT_SERIES)["groups"]
    by_name = {rule["alert"]: rule for rule in group["rules"]}
    sparsity = by_name["SparsityBelowTarget"]
    assert sparsity["for"] == "5m" and sparsity["labels"] == {"severity": "warning"}
    assert sparsity["expr"].startswith(
        '(sparseguard_window_sparsity_ratio{window="5m"} < on(model, level) group_left() '
        '(sparseguard_baseline_center{signal="sparsity"} - on(model, level) '
        '(sparseguard_baseline_tolerance{signal="sparsity"} + on(model, level) '
        '(4 * sqrt(sparseguard_baseline_spread{signal="sparsity"} ^ 2 / on(model, level) '
        'sparseguard_window_requests{window="5m"} + on(model, level) '
        'sparseguard_baseline_error{signal="sparsity"} ^ 2)))))'
    )
    band = by_name["GateConfidenceOutOfBand"]["expr"]
    assert ") or (sparseguard_window_gate_confidence_ratio" in band  # both sides of the band
    assert by_name["SemanticDriftHigh"]["labels"]["severity"] == "critical"
    assert by_name["TelemetryPipelineLag"]["expr"].endswith("_consumer_lag_events > 1000")
    assert set(by_name["SilenceSpikes"]["annotations"]) == {"summary", "description"}


def test_export_is_deterministic_and_the_cli_writes_it(tmp_path: Path) -> None:
    text = exported()
    assert text == exported()
    assert yaml.safe_load(text) == to_prometheus(
        load_rules(DEFAULT_RULES, THRESHOLDS), ALERT_SERIES
    )
    out = tmp_path / "rules.yaml"
    args = argparse.Namespace(rules=None, out=out)
    assert alerts_cli.run_export(args, Settings()) == 0
    assert out.read_text() == text


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool is not on PATH: apt-get install prometheus (CI installs it)")
    return found


def test_promtool_checks_and_unit_tests_pass(tmp_path: Path) -> None:
    binary = promtool()
    rules_file = tmp_path / "sparseguard_rules.yaml"
    rules_file.write_text(exported())
    tests = yaml.safe_load(PROMTOOL_TESTS.read_text())
    tests["rule_files"] = [str(rules_file)]
    tests_file = tmp_path / "promtool_tests.yaml"
    tests_file.write_text(yaml.safe_dump(tests, sort_keys=False))
    for command in (["check", "rules", str(rules_file)], ["test", "rules", str(tests_file)]):
        done = subprocess.run(
            [binary, *command], capture_output=True, text=True, timeout=120, check=False
        )
        assert done.returncode == 0, f"promtool {' '.join(command)}:\n{done.stdout}{done.stderr}"
