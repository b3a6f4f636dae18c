"""The alert study's machinery on made-up requests (the real-model figures come from
`sparseguard eval alerts`): healthy traffic drawn from a baseline's own distribution raises
nothing; a gate-confidence fault, one layer's sparsity shift, a late-silence rise and one answer
repeated are each caught by their rule within minutes and resolve after."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from alerts.rules import DEFAULT_RULES, load_rules
from services.cli import main
from services.cli.eval_alerts import latest_with_baselines
from services.cli.eval_reasons import reason_figures
from services.cli.eval_reasons import render as render_reasons
from services.config import Settings
from services.gateway.trust import Trust, load_judge
from services.replay.measure import FAULTS as FAULT_NAMES
from services.replay.measure import Measured, Measurer, fault_prompts, healthy_prompts
from services.replay.replay import Calibrations, Scenario, events, replay
from services.replay.scoring import Rate, fault_result, firings, rule_scores
from services.replay.study import _rejudged_rates, rejudge
from sparse_engine.calibration.baseline import summarise
from sparse_engine.calibration.store import CalibrationNotFoundError, CalibrationStore
from sparse_engine.data.traffic import Prompt, half_with_system
from sparse_engine.runtime.generation import GenerationStats
from sparse_engine.sparsity.plan import Level
from sparse_engine.sparsity.recorder import SignalSummary
from tests.baseline_fixtures import CALIBRATION, healthy_level
from tests.tiny import tiny_engine

VERSION = "m-balanced-v1"


def request(
    rng: random.Random, kind: str, gate: float, layer_shift: float = 0.0, silence: float = 0.0
) -> Measured:
    """A made-up answer; `layer_shift` moves the last layer's sparsity, `silence` adds to
    every layer's silence rate."""
    layers = [rng.gauss(0.45, 0.02) for _ in range(4)]
    layers[-1] += layer_shift
    signals = SignalSummary(
        sparsity_ratio=rng.gauss(0.45, 0.03),
        sparsity_per_layer=layers,
        gate_confidence=gate,
        activation_stability_pct=rng.gauss(10, 2),
        silence_rate_per_layer=[rng.uniform(0.3, 0.5) + silence for _ in range(4)],
        step_sparsity=[],
        gate_entropy=rng.gauss(0.97, 0.005),
    )
    stats = GenerationStats(
        text="ok",
        level="balanced",
        calibration_version=VERSION,
        prompt_tokens=40,
        completion_tokens=16,
        finish_reason="length",
        time_to_first_token_s=0.05,
        decode_tokens_per_s=40.0,
        prefill_tokens_per_s=800.0,
        input_entropy_bits_per_char=4.0,
        signals=signals,
        semantic_drift_kl=abs(rng.gauss(0.05, 0.02)),
        cached_tokens=rng.choice([0, 30]),
    )
    return Measured("healthy", kind, "prompt", "balanced", stats, Trust(0.9))


def pool(seed: int, n: int, gate_mean: float, repeat: float = 0, **fault: float) -> list[Measured]:
    """`n` made-up answers; with `repeat`, one answer `n` times (one prompt sent over and over)."""
    rng = random.Random(seed)
    kinds = ("chat", "qa")
    if repeat:
        return [request(rng, "chat", gate_mean, **fault)] * n
    return [request(rng, kinds[i % 2], rng.gauss(gate_mean, 0.01), **fault) for i in range(n)]


FAULTS = [
    ("GateConfidenceOutOfBand", {"gate_mean": 0.85}),
    ("LayerSparsityShift", {"gate_mean": 0.95, "layer_shift": -0.03}),
    ("LateSilenceHigh", {"gate_mean": 0.95, "silence": 0.1}),
    ("SignalSpreadCollapsed", {"gate_mean": 0.95, "repeat": 1}),
]


@pytest.mark.parametrize(("rule", "fault"), FAULTS, ids=[f[0] for f in FAULTS])
def test_healthy_replay_is_quiet_and_a_fault_is_caught_by_its_rule(
    rule: str, fault: dict[str, float]
) -> None:
    settings = Settings()
    baseline_pool = pool(1, 200, 0.95)
    baseline = summarise(
        Level.BALANCED,
        [Prompt(m.kind, m.prompt) for m in baseline_pool],
        [m.stats for m in baseline_pool],
        16,
    )
    cals = Calibrations({VERSION: 0.45}, {VERSION: baseline.to_dict()})
    rules = load_rules(DEFAULT_RULES, settings.signals.as_thresholds())
    healthy = {"balanced": pool(2, 100, 0.95)}  # held out: other draws, same distribution

    calm = Scenario("healthy", 7200)
    stream = events(calm, healthy, [], 30, "m")
    quiet = firings(calm, replay(stream, rules, cals, settings.signals, calm.duration_s))
    assert quiet == []

    faulty = Scenario(rule, 4200, rule, "balanced", 1800, 3000)
    stream = events(faulty, healthy, pool(3, 60, **fault), 30, "m")
    found = firings(faulty, replay(stream, rules, cals, settings.signals, faulty.duration_s))
    result = fault_result(faulty, rule, found)
    assert result.detected_s is not None and 300 <= result.detected_s <= 600  # `for: 5m`
    assert result.reset_s is not None and 0 < result.reset_s <= 600
    [score] = rule_scores([rule], {"f": (faulty, found)}, [result])
    assert (score.precision, score.recall) == (1.0, 1.0)


def test_wilson_interval_covers_the_share() -> None:
    low, high = Rate(1, 100).interval()
    assert low < 0.01 < high and high < 0.06
    assert Rate(0, 0).interval() == (0.0, 1.0)


def test_drift_is_sampled_per_replayed_request_not_per_measured_one() -> None:
    """A small pool replayed for hours: each event keeps its KL with the gateway's sample
    rate, drawn per event, so a long window's drift samples come from the whole pool."""
    measured = pool(4, 20, 0.95)
    stream = list(events(Scenario("healthy", 3600), {"balanced": measured}, [], 30, "m", 0, 0.1))
    kept = [e.semantic_drift_kl for e in stream if e.semantic_drift_kl is not None]
    assert 0.05 < len(kept) / len(stream) < 0.15
    assert len(set(kept)) >= 15  # nearly every request of the pool, not a fixed tenth of it
    everything = events(Scenario("healthy", 600), {"balanced": measured}, [], 30, "m")
    assert all(e.semantic_drift_kl is not None for e in everything)


@pytest.mark.slow
def test_fault_prompts_past_an_offset_are_disjoint_from_the_healthy_pool(home: Path) -> None:
    """At offset 0 the model faults answer the healthy pool's own prompts; past it, none."""
    settings = Settings(home=home)
    healthy = {p.text for p in healthy_prompts(settings, 60)}
    assert {p.text for p in fault_prompts(settings, "damaged", 40)} <= healthy
    for fault in FAULT_NAMES:
        first = fault_prompts(settings, fault, 40)
        later = fault_prompts(settings, fault, 40, offset=60)
        assert len(later) == 40
        assert not {p.text for p in later} & ({p.text for p in first} | healthy)


def test_the_alert_study_answers_with_the_readout_a_trust_model_reads(tmp_path: Path) -> None:
    """As the gateway serves: without the readout a trust model fit on it falls back to the
    rule score while its threshold stays the model's."""
    engine = tiny_engine(cache=False)
    settings = Settings(home=tmp_path)
    measurer = Measurer(settings, engine.lm, load_judge(settings, engine.lm.model_id))
    prompts = [Prompt("chat", "Hello there.", "Be brief."), Prompt("code", "def f(x):")]
    measured = measurer._answer(engine, "healthy", Level.BALANCED, prompts)
    assert [m.kind for m in measured] == ["chat", "code"]
    assert [m.system for m in measured] == [True, False]  # judged on its side of the prompt
    assert all(m.stats.readout is not None for m in measured)


def test_the_baseline_keeps_which_requests_came_behind_a_system_prompt() -> None:
    rng = random.Random(8)
    answered = [request(rng, "qa", 0.95) for _ in range(20)]
    prompts = half_with_system([Prompt(m.kind, m.prompt) for m in answered])
    baseline = summarise(Level.BALANCED, prompts, [m.stats for m in answered], 16)
    entropy = baseline.signals["gate_entropy"]
    system = [m.stats.signals.gate_entropy for m in answered[::2] if m.stats.signals]
    assert entropy.system_values["qa"] == sorted(round(v, 6) for v in system)
    assert abs(entropy.system_shift["qa"]) < 0.01  # the made-up answers do not move
    assert len(entropy.kind_values["qa"]) == 20


def test_a_plain_request_is_judged_on_its_side_unless_told_otherwise() -> None:
    """The system prompt raises this made-up kind's gate entropy by 0.03: a plain request
    above every plain baseline request but within the system half is unusual on its side."""
    rng = random.Random(9)
    answered = [request(rng, "qa", 0.95) for _ in range(200)]
    prompts = half_with_system([Prompt(m.kind, m.prompt) for m in answered])
    for p, m in zip(prompts, answered, strict=True):
        if p.system and m.stats.signals:
            m.stats.signals.gate_entropy += 0.03
    baseline = summarise(Level.BALANCED, prompts, [m.stats for m in answered], 16)
    odd = request(rng, "qa", 0.95)
    assert odd.stats.signals is not None
    odd.stats.signals.gate_entropy = 0.995
    assert "gate-degraded" in rejudge(odd, baseline, Settings()).trust.reasons
    assert "gate-degraded" not in rejudge(odd, baseline, Settings(), sided=False).trust.reasons
    behind = replace(odd, system=True)
    assert "gate-degraded" not in rejudge(behind, baseline, Settings()).trust.reasons


def test_the_study_retests_the_sparse_levels_requests_against_the_pooled_sample() -> None:
    """`reasons_pooled`: the same requests judged against the baseline without its kinds'
    samples. A fault between the quiet kind's values and the loud kind's top is unusual for
    the pool only, so only the pooled test fires on it."""
    rng = random.Random(6)
    quiet = [request(rng, "chat", 0.95) for _ in range(100)]
    loud = [request(rng, "code", 0.95, silence=0.4) for _ in range(100)]
    baseline = summarise(
        Level.BALANCED, [Prompt(m.kind, m.prompt) for m in quiet + loud],
        [m.stats for m in quiet + loud], 16,
    )  # fmt: skip
    cals = Calibrations({VERSION: 0.45}, {VERSION: baseline.to_dict()})
    top = sorted(baseline.signals["late_silence"].kind_values["code"])
    fault = [request(rng, "garbage", 0.95, silence=0.0) for _ in range(10)]
    for m in fault:  # every layer at a late silence between code's two largest
        assert m.stats.signals is not None
        m.stats.signals.silence_rate_per_layer[:] = [(top[-1] + top[-2]) / 2] * 4
    healthy = {"balanced": quiet[:20], "dense": quiet[:5]}
    conformal = Settings()  # past the pool's second largest: 1 % on average, not at 90 %
    conformal.signals.reason_confidence = 0.0
    found = _rejudged_rates(healthy, {"garbage": fault}, cals, conformal, "pooled")
    assert set(found["healthy"]["by_level"]) == {"balanced"}  # dense has no calibration
    assert found["healthy"]["by_kind"]["chat"]["silence-spike"]["n"] == 20
    assert found["faults"]["garbage"]["silence-spike"]["hits"] == 10


def test_the_study_retests_requests_against_every_kind_whatever_their_category() -> None:
    """`reasons_every_kind`: a garbage request (text) whose late silence lies within code's is
    unusual for the text kinds it is compared with, not for every kind."""
    rng = random.Random(7)
    quiet = [request(rng, "chat", 0.95) for _ in range(100)]
    code = "def f(x):\n    y = x * 2\n    return y\n\nprint(f(3))"
    loud = [replace(request(rng, "code", 0.95, silence=0.4), prompt=code) for _ in range(100)]
    both = quiet + loud
    baseline = summarise(Level.BALANCED, [Prompt(m.kind, m.prompt) for m in both],
                         [m.stats for m in both], 16)  # fmt: skip
    assert baseline.categories == {"chat": "text", "code": "code"}
    cals = Calibrations({VERSION: 0.45}, {VERSION: baseline.to_dict()})
    fault = [request(rng, "garbage", 0.95, silence=0.0) for _ in range(10)]
    for m in fault:  # every layer at a late silence within code's, above chat's
        assert m.stats.signals is not None
        m.stats.signals.silence_rate_per_layer[:] = [0.8] * 4
    judged = [rejudge(m, baseline, Settings()) for m in fault]
    assert all("silence-spike" in m.trust.reasons for m in judged)
    found = _rejudged_rates({"balanced": quiet[:20]}, {"garbage": fault}, cals, Settings(),
                            "every kind")  # fmt: skip
    assert found["faults"]["garbage"]["silence-spike"]["hits"] == 0


def test_eval_reasons_reports_each_reason_per_level_with_the_prompts_it_fired_on() -> None:
    rng = random.Random(3)
    code = "def f(x):\n    y = x * 2\n    return y\n\nprint(f(3))"
    loud = replace(request(rng, "code", 0.95), prompt=code, system=True)
    quiet = request(rng, "code", 0.95)
    spike = Trust(0.9, reasons=("silence-spike",))
    measured = {
        "balanced": [replace(loud, trust=spike), quiet],
        "dense": [replace(loud, level="dense", trust=spike), quiet],
    }
    every_kind = {"balanced": [loud, quiet]}  # judged again: no reason
    figures = reason_figures("code", measured, 0.01, every_kind)
    assert figures["prompts"] == 2
    assert figures["rates"]["balanced"]["silence-spike"]["hits"] == 1
    assert figures["rates"]["all levels"]["silence-spike"] | {"ci95": None} == {
        "hits": 2, "n": 4, "share": 0.5, "ci95": None,
    }  # fmt: skip
    assert figures["rates"]["all levels"]["gate-degraded"]["hits"] == 0
    fired = figures["fired_on"]["silence-spike"]
    assert fired == [
        {"prompt": code, "category": "code", "system": True, "levels": ["balanced", "dense"]}
    ]
    sides = figures["rates_by_side"]
    assert sides["system prompt"]["silence-spike"] | {"ci95": None} == {
        "hits": 2, "n": 2, "share": 1.0, "ci95": None,
    }  # fmt: skip
    assert sides["no system prompt"]["silence-spike"]["hits"] == 0
    assert figures["rates_by_side_unsided"]["system prompt"]["silence-spike"]["n"] == 0
    again = figures["rates_every_kind"]
    assert (
        again["balanced"]["silence-spike"]["n"] == 2
        and again["balanced"]["silence-spike"]["hits"] == 0
    )
    assert set(again["all these levels"]) == {"silence-spike", "gate-degraded", "monotonous-input"}
    text = render_reasons(figures)
    assert "silence-spike: 1 distinct prompts" in text and "[code, system; balanced,dense]" in text
    assert "no system prompt" in text and "judged whatever their side" in text
    assert "against every kind" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--count", "0"], "--count must be 1 or more"),
        (["--levels", "medium"], "unknown level 'medium'"),
    ],
)
def test_eval_reasons_refuses_bad_arguments_naming_the_fix(
    argv: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.setenv("SPARSEGUARD_HOME", str(tmp_path))
    assert main(["eval", "reasons", "--kind", "code", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_eval_reasons_needs_baselines_only_for_the_levels_it_measures(tmp_path: Path) -> None:
    """`eval reasons --levels balanced` runs with only balanced calibrated and baselined; the
    alert study, which replays every level, still asks for them all."""
    lm = tiny_engine().lm
    settings = Settings(home=tmp_path)
    cal = replace(CALIBRATION, weights_sha256=lm.weights_sha256, baseline=healthy_level().to_dict())
    calibrations = CalibrationStore(settings.calibrations_dir)
    calibrations.save(cal)
    found = latest_with_baselines(settings, lm, [Level.DENSE, Level.BALANCED])
    assert list(found) == [Level.BALANCED] and found[Level.BALANCED].version == cal.version
    with pytest.raises(CalibrationNotFoundError, match="calibrate --level conservative"):
        latest_with_baselines(settings, lm)  # every sparse level
    later = "2099-01-01T00:00:00+00:00"
    calibrations.save(replace(cal, version="", baseline=None, created_at=later))
    with pytest.raises(ValueError, match="no healthy baseline"):
        latest_with_baselines(settings, lm, [Level.BALANCED])
