"""One settings section for every signal threshold: changing `SPARSEGUARD_SIGNALS__*` moves the
gateway's trust reasons, the aggregator's counts, the alert rules and the dashboards together.
Every expectation is read from the settings, never from a copied number."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError
from sqlalchemy.orm import sessionmaker

from alerts.definitions import Deviation
from alerts.rules import DEFAULT_RULES, RuleError, load_rules, parse_rules
from dashboards import dashboards
from dashboards.silence import silence
from services.aggregator import windows
from services.aggregator.alert_loop import AlertLoop
from services.aggregator.loop import Aggregator
from services.aggregator.metrics import AggregatorMetrics
from services.cli import main
from services.config import (
    DEFAULT_ACT_ON,
    DEFAULT_MODEL,
    AlertSettings,
    Settings,
    SignalSettings,
    TrustSettings,
)
from services.gateway.reasons import trust_reasons
from services.telemetry import schema
from services.telemetry.schema import REASON_SILENCE_SPIKE, TelemetryEvent
from sparse_engine.model import catalog
from sparse_engine.trust.features import RequestSignals, rule_score

NOW = datetime(2025, 3, 1, tzinfo=UTC)
SPIKE_PANEL = "Silence rate per layer (1h window)"
GATE_RULE = "GateConfidenceOutOfBand"


def spike_settings(monkeypatch: pytest.MonkeyPatch, value: float) -> Settings:
    monkeypatch.setenv("SPARSEGUARD_SIGNALS__SPIKE_SILENCE", str(value))
    return Settings()


def answer(late_band: int, late_silence: float) -> RequestSignals:
    """An answer's signals whose last `late_band` layers are `late_silence` silent."""
    return RequestSignals(silence_per_layer=[0.0, *[late_silence] * late_band])


def reasons(settings: Settings, sig: RequestSignals) -> tuple[str, ...]:
    """The gateway's reasons for the answer, scored as without a trust model."""
    score = rule_score(sig, settings.signals.late_band)
    return trust_reasons(sig, score, settings.signals, settings.trust.min_score)


def event(sig: RequestSignals, found: tuple[str, ...], i: int) -> TelemetryEvent:
    """The telemetry event of the answer, carrying the gateway's reasons."""
    return TelemetryEvent(
        trace_id=f"t{i}",
        time=NOW - timedelta(seconds=1),
        model="m",
        calibration_version="v1",
        level="balanced",
        mode="serve",
        api="openai",
        status="ok",
        silence_rate_per_layer=sig.silence_per_layer,
        trust_reasons=list(found),
    )


def spikes_total(events: list[TelemetryEvent]) -> float:
    """`sparseguard_silence_spikes_total` after the aggregator's metrics fold `events` (a
    series never incremented is absent: 0)."""
    registry = CollectorRegistry()
    AggregatorMetrics(registry).observe(events, NOW)
    labels = {"model": "m", "level": "balanced"}
    return registry.get_sample_value("sparseguard_silence_spikes_total", labels) or 0.0


def spike_step(signals: SignalSettings) -> list[float]:
    panel = next(p for p in silence(signals).panels() if p.title == SPIKE_PANEL)
    return [value for value, color in panel.steps if color == "red"]


def test_changing_the_spike_setting_moves_gateway_aggregator_and_dashboard_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    low, high = spike_settings(monkeypatch, 0.7), spike_settings(monkeypatch, 0.9)
    assert low.signals.spike_silence < high.signals.spike_silence
    assert low.signals.late_band == high.signals.late_band
    between = (low.signals.spike_silence + high.signals.spike_silence) / 2
    sig = answer(low.signals.late_band, between)
    assert sig.late_silence(low.signals.late_band) == pytest.approx(between)

    # (a) the gateway: a spike under the lower threshold only
    on_low, on_high = reasons(low, sig), reasons(high, sig)
    assert REASON_SILENCE_SPIKE in on_low
    assert REASON_SILENCE_SPIKE not in on_high

    # (b) the aggregator counts the reasons the gateway put in the events
    assert spikes_total([event(sig, on_low, 0), event(sig, on_low, 1)]) == 2
    assert spikes_total([event(sig, on_high, 0), event(sig, on_high, 1)]) == 0
    folded = {}
    for name, found in (("low", on_low), ("high", on_high)):
        state = windows.apply(windows.new_state(), [event(sig, found, 0)])
        folded[name] = windows.snapshot(state, NOW)[("m", "balanced")]["5m"].silence_spikes
    assert folded == {"low": 1, "high": 0}

    # (c) the silence dashboard draws the spike line at the setting
    for settings in (low, high):
        assert spike_step(settings.signals) == [settings.signals.spike_silence]
    assert spike_step(SignalSettings()) == [SignalSettings().spike_silence]


def test_the_late_band_setting_reaches_the_gateway() -> None:
    default, wide = Settings(), Settings(signals=SignalSettings(late_band=4))
    assert wide.signals.late_band > default.signals.late_band
    spike = default.signals.spike_silence
    # The default band's layers are fully silent; the wider band takes in a silent-free layer,
    # which brings its mean under the threshold.
    sig = answer(default.signals.late_band, 1.0)
    assert sig.late_silence(wide.signals.late_band) < spike < sig.late_silence()
    assert REASON_SILENCE_SPIKE in reasons(default, sig)
    assert REASON_SILENCE_SPIKE not in reasons(wide, sig)


def test_alert_rules_loaded_with_a_changed_gate_band_get_that_band(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SPARSEGUARD_SIGNALS__GATE_BAND", "[0.6, 0.97]")
    monkeypatch.setenv("SPARSEGUARD_SIGNALS__ALERT_Z", "2.5")
    settings = Settings()
    band = settings.signals.gate_band
    assert band != SignalSettings().gate_band
    rules = {r.name: r for r in load_rules(DEFAULT_RULES, settings.signals.as_thresholds())}
    assert rules[GATE_RULE].threshold == Deviation("gate_confidence", 2.5)
    # The aggregator's evaluator, its fold and the CLI's export read the same settings: the
    # band is the fallback reference of a key without a baseline, z is the rules' z.
    loop = AlertLoop(AlertSettings(), sessionmaker(), CollectorRegistry(), signals=settings.signals)
    gate = next(r for r in loop.rules if r.name == GATE_RULE).threshold
    assert gate == Deviation("gate_confidence", 2.5)
    aggregator = Aggregator(settings, sessionmaker(), AggregatorMetrics(CollectorRegistry()))
    assert aggregator.state.config.gate_band == band
    windows.apply(aggregator.state, [event(answer(3, 0.1), (), 0)])
    summary = aggregator.snapshot()[("m", "balanced")]["5m"]
    ref = summary.references["gate_confidence"]
    assert (ref.center - ref.tolerance, ref.center + ref.tolerance) == pytest.approx(band)
    assert main(["alerts", "export-prometheus"]) == 0
    exported = capsys.readouterr().out
    assert '(2.5 * sqrt(sparseguard_baseline_spread{signal="gate_confidence"}' in exported


def test_every_signal_setting_is_a_rule_threshold_name() -> None:
    signals = SignalSettings()
    thresholds = signals.as_thresholds()
    assert set(thresholds) == set(SignalSettings.model_fields)
    assert thresholds["gate_band"] == signals.gate_band
    rules = {r.name: r for r in load_rules(DEFAULT_RULES, thresholds)}
    assert rules["SemanticDriftHigh"].threshold == Deviation(
        "drift_kl", signals.alert_z, "drift_samples"
    )
    assert rules["PrefixCacheHitRateLow"].threshold == Deviation("cache_hit", signals.alert_z)
    assert rules["GateDegraded"].threshold == Deviation("gate_entropy", signals.alert_z)
    assert rules["GoldenDriftHigh"].threshold == signals.drift_budget


def rule(threshold: str, op: str = "<") -> str:
    return (
        "rules:\n  - name: R\n    metric: gate_confidence_mean\n    window: 5m\n"
        f"    op: '{op}'\n    threshold: {threshold}\n"
    )


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (
            rule("{signal: nope}"),
            "unknown signal 'nope' (known: alert_z, cache_drop_effect, cache_hit_min, ",
        ),
        (rule("{signal: gate_band}"), "signal 'gate_band' is a band, not a number"),
        (rule("{signal: spike_silence}", "outside"), "is a number; op 'outside' needs a band"),
        (rule("{signal: gate_band, factor: 2}"), "unknown key 'factor'"),
        (
            rule("{relative_to: sparsity_target, default: {signal: nope}}"),
            "unknown signal 'nope'",
        ),
    ],
)
def test_bad_signal_references_name_the_line_and_reason(text: str, reason: str) -> None:
    with pytest.raises(RuleError, match=r"^mine\.yaml:6: ") as caught:
        parse_rules(text, "mine.yaml", SignalSettings().as_thresholds())
    assert reason in str(caught.value)


def test_a_rule_naming_a_signal_needs_signal_values() -> None:
    with pytest.raises(RuleError, match="no signal values were given: pass signals="):
        parse_rules(rule("{signal: cache_hit_min}"), "mine.yaml")
    with pytest.raises(RuleError, match="no signal values"):
        load_rules(DEFAULT_RULES)


def test_bad_and_moved_settings_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValidationError, match="low <= high"):
        SignalSettings(gate_band=(0.9, 0.8))
    with pytest.raises(ValidationError, match="SPARSEGUARD_SIGNALS__SPIKE_SILENCE"):
        TrustSettings.model_validate({"spike_silence": 0.9})
    monkeypatch.setenv("SPARSEGUARD_JOBS__DRIFT_BUDGET_BLEU", "1.0")
    with pytest.raises(ValidationError, match=r"set SPARSEGUARD_SIGNALS__DRIFT_BUDGET \["):
        Settings()
    monkeypatch.delenv("SPARSEGUARD_JOBS__DRIFT_BUDGET_BLEU")
    monkeypatch.setenv("SPARSEGUARD_SIGNALS__DRIFT_RECALIBRATE_BLEU", "1.2")  # BLEU, renamed
    with pytest.raises(ValidationError, match=r"no longer BLEU.*SIGNALS__DRIFT_RECALIBRATE \["):
        Settings()


def test_the_cli_names_a_bad_setting_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SPARSEGUARD_HOME", str(tmp_path))
    monkeypatch.setenv("SPARSEGUARD_GATEWAY__MODE", "proxy")
    monkeypatch.setenv("SPARSEGUARD_TRUST__ROUTE_MODES", '{"/v1/chat/completions": "closed"}')
    assert main(["alerts", "export-prometheus"]) == 2
    err = capsys.readouterr().err
    assert "sparseguard: error:" in err and "/v1/chat/completions by closed-mode" in err
    assert "Traceback" not in err


def test_the_dashboards_draw_the_signal_settings() -> None:
    signals = SignalSettings(
        gate_band=(0.7, 0.9), drift_kl_24h=2.0, drift_budget=0.5, drift_recalibrate=1.5
    )
    panels = {p.title: p for d in dashboards(signals) for p in d.panels()}
    low, high = signals.gate_band
    gate = panels[f"Gate confidence (healthy band {low:g}-{high:g})"]
    assert [v for v, _ in gate.steps] == [low, high, signals.monotonous_confidence]
    drift = panels["Semantic drift KL(dense || sparse)"]
    assert drift.steps == ((signals.drift_kl_24h, "red"),)
    golden = panels["Golden-set drift per level (points)"]
    assert [v for v, _ in golden.steps] == [signals.drift_budget, signals.drift_recalibrate]


def test_the_names_settings_write_out_are_the_libraries_ones() -> None:
    """services.config imports neither the engine nor the event schema, so it spells these."""
    assert DEFAULT_MODEL == catalog.DEFAULT_MODEL
    assert DEFAULT_ACT_ON == (schema.REASON_SILENCE_SPIKE, schema.REASON_LOW_SCORE)
