"""Healthy baselines and the tests against them: conformal p-values and the confidence rank
hold their false-positive budget, window rules need a shift beyond the tolerance by more than
the sampling spread of n requests, and trust models keep a flag threshold per level. The
per-request reasons against a baseline: test_reasons.py."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from alerts.definitions import Deviation
from alerts.evaluator import EvalState, evaluate
from alerts.rules import DEFAULT_RULES, load_rules
from alerts.samples import samples_from_windows
from services.aggregator.references import MIN_TRAILING, Reference, references
from services.config import SignalSettings, TrustSettings
from services.gateway.trust import TrustJudge
from sparse_engine.calibration.baseline import LevelBaseline, SignalBaseline, drift_sampled
from sparse_engine.calibration.conformal import binomial_tail, ceiling_rank, sample_needed
from sparse_engine.data.traffic import Prompt, half_with_system
from sparse_engine.trust.features import RequestSignals
from sparse_engine.trust.flagging import conformal_floor, set_flag_thresholds
from sparse_engine.trust.model import TrustModel, fit
from tests.baseline_fixtures import baseline_of, healthy_level

NOW = datetime(2026, 1, 1, tzinfo=UTC)


# Derandomized: conditional on one baseline the rate is random, and a baseline of 20 values
# whose maximum falls under the 58th percentile (probability 2e-5) once gave a rate of 0.42;
# the bound below is for typical baselines, the exact guarantee is tested on average below.
@settings(max_examples=30, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31), n=st.integers(20, 300), budget=st.sampled_from([0.01, 0.05]))
def test_conformal_p_value_keeps_its_budget_on_exchangeable_values(
    seed: int, n: int, budget: float
) -> None:
    rng = random.Random(seed)
    healthy = SignalBaseline.of({"all": [rng.gauss(0, 1) for _ in range(n)]})
    fresh = [rng.gauss(0, 1) for _ in range(4000)]
    rate = sum(healthy.p_above(v) <= budget for v in fresh) / len(fresh)
    # Conditional on one baseline the rate is Beta-distributed around floor(a(n+1))/(n+1);
    # bound it loosely, and exactly in expectation below.
    assert rate <= budget + 4 * math.sqrt(budget / n) + 0.01


def test_conformal_p_value_is_exact_on_average() -> None:
    rng = random.Random(1)
    rates = []
    for _ in range(300):
        healthy = SignalBaseline.of({"all": [rng.random() for _ in range(99)]})
        rates.append(healthy.p_above(rng.random()) <= 0.01)
    assert sum(rates) / len(rates) <= 0.01 + 3 * math.sqrt(0.01 / 300)
    assert healthy.p_above(2.0) == pytest.approx(1 / 100)  # above all: the smallest p
    assert healthy.p_above(-1.0) == 1.0


def test_signal_baseline_statistics_and_tolerance() -> None:
    stats = SignalBaseline.of({"a": [1.0, 1.0, 1.0], "b": [3.0, 3.0, 3.0]})
    assert stats.mean == 2.0 and stats.sd == 1.0 and stats.median == 2.0
    assert stats.tolerance == 1.0  # each kind's mean is one away from the mean of all
    assert stats.quantiles[0] == 1.0 and stats.quantiles[-1] == 3.0
    assert SignalBaseline.from_dict(stats.to_dict()) == stats
    with pytest.raises(ValueError, match="at least one"):
        SignalBaseline.of({"a": []})


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    counts=st.lists(st.integers(0, 60), min_size=1, max_size=4),
    share=st.sampled_from([0.1, 0.25, 0.3, 0.5, 0.7, 1.0]),
)
def test_drift_is_sampled_on_its_share_of_each_kind_and_both_sides(
    counts: list[int], share: float
) -> None:
    kinds = [f"k{i}" for i in range(len(counts))]
    mixed = [
        Prompt(k, f"{k} {i}")
        for i in range(max(counts))
        for k, c in zip(kinds, counts, strict=True)
        if i < c
    ]
    prompts = half_with_system(mixed)
    chosen = drift_sampled(prompts, share)
    for kind, count in zip(kinds, counts, strict=True):
        picked = [p for p, c in zip(prompts, chosen, strict=True) if c and p.kind == kind]
        assert abs(len(picked) - share * count) <= 2, "the share of the kind, to a pair"
        with_system = sum(p.system is not None for p in picked)
        assert abs(with_system - (len(picked) - with_system)) <= 1, "both sides alike"
    assert all(drift_sampled(prompts, 1.0))
    with pytest.raises(ValueError, match="not in"):
        drift_sampled(prompts, 0.0)


def test_level_baseline_round_trips_through_json() -> None:
    found = baseline_of({"gate_confidence": [0.9, 0.95, 0.97, 0.93]})
    assert LevelBaseline.from_dict(found.to_dict()) == found


@pytest.mark.parametrize("budget", [0.01, 0.05, 0.2])
def test_conformal_floor_flags_at_most_the_budget(budget: float) -> None:
    rng = random.Random(3)
    scores = [rng.random() for _ in range(199)]
    floor = conformal_floor(scores, budget)
    fresh = [rng.random() for _ in range(20000)]
    rate = sum(s < floor for s in fresh) / len(fresh)
    spread = 3 * math.sqrt(budget * (1 - budget) / len(scores))  # of one baseline's threshold
    assert budget - spread <= rate <= budget + spread
    assert conformal_floor(scores[:10], 0.01) == -math.inf  # too few to spend 1 %


def test_the_ceiling_rank_holds_the_budget_with_the_confidence_asked() -> None:
    """Firing past the k-th largest of n healthy values: the conformal rank holds 1 % on
    average over samples only (half the samples of 400 spend more); the confidence rank
    holds it on 90 % of samples."""
    assert ceiling_rank(99, 0.01) == 1 and ceiling_rank(98, 0.01) == 0
    assert ceiling_rank(400, 0.01) == 4 and ceiling_rank(400, 0.01, 0.9) == 2
    assert ceiling_rank(100, 0.01, 0.9) == 1  # too few for 90 %: past the largest
    assert binomial_tail(100, 0.01, 1) == pytest.approx(1 - 0.99**100)
    assert sample_needed(0.01, 0.9) == 230
    assert binomial_tail(230, 0.01, 1) >= 0.9 > binomial_tail(229, 0.01, 1)
    rng = random.Random(4)
    for confidence, most_over in ((0.0, 0.6), (0.9, 0.1)):
        k = ceiling_rank(400, 0.01, confidence)
        over = 0
        for _ in range(2000):  # uniform healthy values: past a threshold t fires on 1 - t
            ceiling = sorted(rng.random() for _ in range(400))[-k]
            over += 1 - ceiling > 0.01
        assert over / 2000 <= most_over + 3 * math.sqrt(most_over * (1 - most_over) / 2000)
        if confidence == 0.0:
            assert over / 2000 > 0.3  # the conformal rank is over budget on many samples


def test_deviation_bounds_shrink_with_requests() -> None:
    rule = Deviation("sparsity", z=4.0)
    values = {
        "baseline_sparsity_center": 0.45,
        "baseline_sparsity_spread": 0.05,
        "baseline_sparsity_tolerance": 0.01,
        "baseline_sparsity_error": 0.0,
    }
    few = rule.bounds({**values, "requests": 16})
    many = rule.bounds({**values, "requests": 1600})
    assert few == pytest.approx((0.45 - 0.01 - 0.05, 0.45 + 0.01 + 0.05))
    assert many == pytest.approx((0.45 - 0.01 - 0.005, 0.45 + 0.01 + 0.005))
    assert rule.bounds(values) is None  # no count: no data
    assert rule.bounds({"requests": 10}) is None  # no baseline: no data
    # The baseline's own sampling error widens the band: a baseline of 36 requests.
    wide = rule.bounds({**values, "requests": 1600, "baseline_sparsity_error": 0.05 / 6})
    assert wide is not None and wide[0] < 0.45 - 0.01 - 4 * 0.05 / 6


def test_references_fall_back_to_the_published_numbers() -> None:
    signals = SignalSettings()
    refs = references(signals, None, 0.45, (0, None, 0.0))
    assert refs["sparsity"] == Reference(0.45, 0.0, 0.0, "published")
    low, high = signals.gate_band
    assert refs["gate_confidence"].center - refs["gate_confidence"].tolerance == pytest.approx(low)
    assert refs["gate_confidence"].center + refs["gate_confidence"].tolerance == pytest.approx(high)
    assert "cache_hit" not in refs  # no trailing 24 h yet: no data, not the published floor
    trailing = references(signals, None, None, (MIN_TRAILING, 0.6, 0.2))["cache_hit"]
    error = 0.2 / math.sqrt(MIN_TRAILING)  # the trailing mean's own standard error
    drop = signals.cache_drop_effect * 0.6
    assert trailing == Reference(0.6, 0.2, drop, "trailing-24h", error)
    measured = references(signals, healthy_level().to_dict(), 0.45, (0, None, 0.0))
    assert measured["gate_confidence"].source == "baseline"
    assert measured["silence_spike"].center == signals.reason_budget


class Summary:
    """A window summary as the aggregator makes it, reduced to what the rule reads."""

    def __init__(self, mean: float, requests: int, refs: dict[str, Reference]) -> None:
        self.requests = requests
        self.sparsity_mean = mean
        self.references = refs

    def __getattr__(self, name: str) -> None:
        return None  # every other window metric: no data


@pytest.mark.parametrize(
    ("mean", "requests", "fires"),
    [
        (0.444, 20, False),  # the demo's "0.446 against 0.450": noise
        (0.420, 20, False),  # 0.03 short on 20 requests: within 4 standard errors
        (0.420, 600, True),  # the same shortfall on 600 requests: significant
        (0.435, 600, False),  # significant, but within the tolerance
    ],
)
def test_sparsity_below_target_needs_a_significant_shortfall(
    mean: float, requests: int, fires: bool
) -> None:
    signals = SignalSettings()
    rules = [
        replace(r, for_s=0.0)
        for r in load_rules(DEFAULT_RULES, signals.as_thresholds())
        if r.name == "SparsityBelowTarget"
    ]
    refs = {"sparsity": Reference(0.45, 0.06, 0.012, "baseline")}
    snap = {("m", "balanced"): {"5m": Summary(mean, requests, refs)}}
    _, transitions = evaluate(
        EvalState(), rules, samples_from_windows(snap), NOW, repeat_interval_s=3600
    )
    assert [t.state for t in transitions] == (["firing"] if fires else [])


def test_flag_threshold_spends_the_flag_budget_on_healthy_answers() -> None:
    rng = random.Random(7)

    def answer(right: bool) -> RequestSignals:
        lp = rng.gauss(-0.5 if right else -2.0, 0.5)
        return RequestSignals(
            silence_per_layer=[rng.uniform(0.2, 0.4)] * 4, mean_logprob=lp, min_logprob=lp - 1
        )

    labels = [i % 2 == 0 for i in range(80)]
    model = fit([answer(r) for r in labels], labels, model_id="m", level="balanced", fit_data={})
    assert model.flag_thresholds == {}  # until scored on healthy traffic
    healthy = [answer(rng.random() < 0.8) for _ in range(199)]
    scores = set_flag_thresholds(model, {"chat": healthy}, 0.05, "balanced")["chat"]
    threshold = model.flag_thresholds["balanced"]
    assert model.flag_fit["balanced"]["kinds"]["chat"]["requests"] == 199
    assert sum(s < threshold for s in scores) <= 0.05 * 200
    held_out = [model.score(answer(rng.random() < 0.8)) for _ in range(2000)]
    assert sum(s < threshold for s in held_out) / 2000 <= 0.05 + 0.05
    # A sparser level's healthy answers score lower: their own threshold, not balanced's.
    worse = [answer(rng.random() < 0.5) for _ in range(199)]
    set_flag_thresholds(model, {"chat": worse}, 0.05, "aggressive")
    assert model.flag_thresholds["aggressive"] < threshold
    judge = TrustJudge(TrustSettings(min_score=0.3), SignalSettings(), model)
    assert judge.flag_below(model, None, "aggressive") == model.flag_thresholds["aggressive"]
    assert judge.flag_below(model, None, "conservative") == 0.3  # none measured there
    reloaded = TrustModel.from_dict(model.to_dict())
    assert reloaded.flag_thresholds == model.flag_thresholds
    assert reloaded.kind_thresholds == model.kind_thresholds


CODE_PROMPT = "def f(x):\n    y = x + 1\n    return y\n\nprint(f(1))"


def test_flag_thresholds_hold_the_budget_on_each_kind_of_a_category() -> None:
    """A kind whose healthy answers score low (prose continuations are not questions) gets its
    own threshold: at chat's, most of it would be flagged. A request is flagged only below
    every kind of its category; code is judged by code alone."""
    rng = random.Random(11)

    def answer(lp_mean: float) -> RequestSignals:
        lp = rng.gauss(lp_mean, 0.5)
        return RequestSignals(
            silence_per_layer=[rng.uniform(0.2, 0.4)] * 4, mean_logprob=lp, min_logprob=lp - 1
        )

    labels = [i % 2 == 0 for i in range(80)]
    model = fit(
        [answer(-0.5 if r else -2.0) for r in labels],
        labels,
        model_id="m",
        level="balanced",
        fit_data={},
    )
    means = {"chat": -0.5, "prose": -2.0, "code": -1.2}
    prompts = [Prompt(kind, CODE_PROMPT if kind == "code" else "Tell me.") for kind in means]
    healthy = {kind: [answer(m) for _ in range(199)] for kind, m in means.items()}
    set_flag_thresholds(model, healthy, 0.05, "balanced", prompts)
    by_kind = model.kind_thresholds["balanced"]
    assert model.flag_categories == {"chat": "text", "prose": "text", "code": "code"}
    assert by_kind["prose"] < by_kind["code"] < by_kind["chat"]
    judge = TrustJudge(TrustSettings(), SignalSettings(), model)
    text = judge.flag_below(model, None, "balanced", category="text")
    assert text == by_kind["prose"] == model.flag_thresholds["balanced"]
    assert judge.flag_below(model, None, "balanced", category="code") == by_kind["code"]
    for kind, m in means.items():  # held out: each kind within its budget at its category's
        category = "code" if kind == "code" else "text"
        below = judge.flag_below(model, None, "balanced", category=category)
        flagged = sum(model.score(answer(m)) < below for _ in range(1000)) / 1000
        assert flagged <= 0.05 + 0.03, (kind, flagged)
    # What a chat-only threshold did: most of prose flagged.
    prose = [model.score(answer(means["prose"])) for _ in range(1000)]
    assert sum(s < by_kind["chat"] for s in prose) / 1000 > 0.5
    assert TrustModel.from_dict(model.to_dict()).flag_categories == model.flag_categories
    # With 90 % confidence over the sample (the fit's default): a lower rank of each kind's.
    sure = TrustModel.from_dict(model.to_dict())
    set_flag_thresholds(sure, healthy, 0.05, "balanced", prompts, confidence=0.9)
    assert all(sure.kind_thresholds["balanced"][k] < by_kind[k] for k in means)
    assert sure.flag_fit["balanced"]["confidence"] == 0.9
