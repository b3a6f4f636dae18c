"""Healthy baselines and the tests against them: conformal p-values hold their false-positive
budget, per-request reasons follow the baseline of the answer's level, and window rules need
a shift beyond the tolerance by more than the sampling spread of n requests."""

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
from services.gateway.reasons import BaselineBook, trust_reasons
from services.gateway.trust import TrustJudge
from services.telemetry.schema import (
    REASON_GATE_DEGRADED,
    REASON_MONOTONOUS_INPUT,
    REASON_SILENCE_SPIKE,
)
from sparse_engine.calibration.baseline import LevelBaseline, SignalBaseline
from sparse_engine.calibration.conformal import binomial_tail, ceiling_rank, sample_needed
from sparse_engine.runtime.generation import GenerationStats
from sparse_engine.sparsity.recorder import SignalSummary
from sparse_engine.trust.features import RequestSignals
from sparse_engine.trust.flagging import conformal_floor, set_flag_threshold
from sparse_engine.trust.model import TrustModel, fit

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def baseline_of(values: dict[str, list[float]], kinds: int = 2) -> LevelBaseline:
    """A baseline whose signals hold `values`, split round-robin over `kinds` kinds."""
    signals = {
        name: SignalBaseline.of({f"k{k}": vs[k::kinds] for k in range(kinds)})
        for name, vs in values.items()
    }
    n = len(next(iter(values.values())))
    return LevelBaseline("balanced", n, [f"k{k}" for k in range(kinds)], 16, signals)


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


def healthy_level() -> LevelBaseline:
    rng = random.Random(5)
    return baseline_of(
        {
            "late_silence": [rng.uniform(0.80, 0.90) for _ in range(200)],
            "gate_entropy": [rng.uniform(0.96, 0.98) for _ in range(200)],
            "gate_confidence": [rng.uniform(0.94, 0.97) for _ in range(200)],
        }
    )


def test_reasons_against_a_baseline_ignore_the_published_numbers() -> None:
    """This model's healthy conservative traffic sits above every published line (gate
    confidence 0.95+, entropy 0.96+, late silence 0.8+): against its baseline nothing fires."""
    signals = SignalSettings()
    sig = RequestSignals(silence_per_layer=[0.85] * 6, gate_confidence=0.96, gate_entropy=0.97)
    assert trust_reasons(sig, 1.0, signals, 0.3) == (
        REASON_SILENCE_SPIKE,
        REASON_GATE_DEGRADED,
        REASON_MONOTONOUS_INPUT,
    )
    assert trust_reasons(sig, 1.0, signals, 0.3, baseline=healthy_level()) == ()


def test_reasons_fire_beyond_everything_healthy() -> None:
    signals = SignalSettings()
    odd = RequestSignals(silence_per_layer=[0.99] * 6, gate_confidence=0.999, gate_entropy=0.999)
    found = trust_reasons(odd, 1.0, signals, 0.3, baseline=healthy_level())
    assert found == (REASON_SILENCE_SPIKE, REASON_GATE_DEGRADED, REASON_MONOTONOUS_INPUT)
    dense = trust_reasons(odd, 1.0, signals, 0.3, is_dense=True, baseline=healthy_level())
    assert dense == (REASON_SILENCE_SPIKE,)  # no gate on a dense pass


def test_reasons_hold_the_budget_on_every_kind_where_the_pooled_test_does_not() -> None:
    """One kind (code) sits higher than the others, as late silence does on code: the pooled
    1 % test spends its budget on that kind alone; the per-kind test keeps 1 % on each."""
    rng = random.Random(7)

    def draw(kind: str, n: int) -> list[float]:
        return [rng.gauss(0.5 if kind == "code" else 0.2, 0.05) for _ in range(n)]

    kinds = ("chat", "qa", "code", "prose")
    healthy = SignalBaseline.of({k: draw(k, 100) for k in kinds})
    assert SignalBaseline.from_dict(healthy.to_dict()) == healthy
    fresh = draw("code", 20000)
    pooled = sum(healthy.p_above(v) <= 0.01 for v in fresh) / len(fresh)
    per_kind = sum(healthy.unusual(v, 0.01) for v in fresh) / len(fresh)
    assert pooled > 0.03  # the 4 pooled tail slots are all code's: 4 % of code
    assert per_kind <= 0.01 + 4 * math.sqrt(0.01 / 100)
    for kind in ("chat", "qa", "prose"):
        others = draw(kind, 5000)
        assert sum(healthy.unusual(v, 0.01) for v in others) / 5000 <= 0.025
    assert healthy.unusual(2.0, 0.01) and not healthy.unusual(0.45, 0.01)
    # A baseline made before kinds were kept tests against the pooled sample.
    old = SignalBaseline.from_dict(
        {k: v for k, v in healthy.to_dict().items() if k != "kind_values"}
    )
    assert old.kind_values == {}
    assert old.unusual(0.45, 0.01) == (healthy.p_above(0.45) <= 0.01)


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


def test_a_request_is_tested_against_its_own_side_of_the_system_prompt() -> None:
    """The system prompt moves a kind's values (gate entropy, README); each request is
    compared with the kind's sample moved to its side: the plain half as is, the system half
    less the shift, for a plain request."""
    rng = random.Random(11)
    plain = [rng.uniform(0.0, 1.0) for _ in range(100)]
    system = [rng.uniform(1.0, 2.0) for _ in range(100)]
    healthy = SignalBaseline.of({"qa": plain + system}, {"qa": system})
    assert healthy.system_shift["qa"] == pytest.approx(1.0, abs=0.1)
    assert sorted(healthy.system_values["qa"]) == healthy.system_values["qa"]
    assert len(healthy.kind_sample("qa", True)) == 200
    assert healthy.unusual(1.2, 0.01, 0.9, system=False)  # past every plain value
    assert not healthy.unusual(1.2, 0.01, 0.9)  # unknown side: within the system half
    assert not healthy.unusual(1.2, 0.01, 0.9, system=True)
    assert healthy.unusual(2.2, 0.01, 0.9, system=True)
    assert SignalBaseline.from_dict(healthy.to_dict()) == healthy
    old = {k: v for k, v in healthy.to_dict().items() if not k.startswith("system_")}
    assert not SignalBaseline.from_dict(old).unusual(1.2, 0.01, 0.9, system=False)
    sig = RequestSignals(silence_per_layer=[0.1] * 6, gate_confidence=0.5, gate_entropy=1.2)
    level = LevelBaseline("balanced", 200, ["qa"], 16, {"gate_entropy": healthy})
    signals = SignalSettings()
    assert trust_reasons(sig, 1.0, signals, 0.3, baseline=level, system=False) == (
        REASON_GATE_DEGRADED,
    )
    assert trust_reasons(sig, 1.0, signals, 0.3, baseline=level, system=True) == ()
    assert level.pooled().signals["gate_entropy"].system_shift == {}


def test_a_pooled_baseline_tests_against_every_kind_together() -> None:
    rng = random.Random(8)
    loud = [rng.uniform(0.5, 0.9) for _ in range(100)]  # one kind's late silence above the rest
    by_kind = {"code": loud, **{k: [rng.uniform(0.1, 0.3) for _ in range(100)] for k in "abc"}}
    level = LevelBaseline(
        "balanced", 400, sorted(by_kind), 16, {"late_silence": SignalBaseline.of(by_kind)}
    )
    between = (sorted(loud)[-2] + sorted(loud)[-1]) / 2  # the pool's top 0.5 %, under code's max
    sig = RequestSignals(silence_per_layer=[between] * 6, gate_confidence=0.5, gate_entropy=0.5)
    signals = SignalSettings()
    assert trust_reasons(sig, 1.0, signals, 0.3, baseline=level) == ()
    assert trust_reasons(sig, 1.0, signals, 0.3, baseline=level.pooled()) == (REASON_SILENCE_SPIKE,)
    assert level.pooled().signals["late_silence"].kind_values == {}


def test_a_request_is_compared_with_the_kinds_of_its_own_category() -> None:
    """Late silence between the text kinds' top and code's: unusual for a text request, not
    for a code one. Tested against every kind, code's sample hides it (garbage on SmolLM2)."""
    rng = random.Random(9)
    loud = [rng.uniform(0.5, 0.9) for _ in range(100)]
    by_kind = {"code": loud, **{k: [rng.uniform(0.1, 0.3) for _ in range(100)] for k in "abc"}}
    categories = {"code": "code", "a": "text", "b": "text", "c": "text"}
    level = LevelBaseline(
        "balanced", 400, sorted(by_kind), 16, {"late_silence": SignalBaseline.of(by_kind)},
        categories=categories,
    )  # fmt: skip
    assert level.kinds_of("text") == ["a", "b", "c"] and level.kinds_of("code") == ["code"]
    assert level.kinds_of("other") is None and level.kinds_of(None) is None
    sig = RequestSignals(silence_per_layer=[0.45] * 6, gate_confidence=0.5, gate_entropy=0.5)
    signals = SignalSettings()
    text = trust_reasons(sig, 1.0, signals, 0.3, baseline=level, category="text")
    assert text == (REASON_SILENCE_SPIKE,)
    assert trust_reasons(sig, 1.0, signals, 0.3, baseline=level, category="code") == ()
    assert trust_reasons(sig, 1.0, signals, 0.3, baseline=level) == ()  # every kind
    assert LevelBaseline.from_dict(level.to_dict()) == level
    old = {k: v for k, v in level.to_dict().items() if k != "categories"}
    assert LevelBaseline.from_dict(old).kinds_of("text") is None  # before categories: all
    # The gateway's judge tells the category from the user's text, not the whole prompt.
    book = BaselineBook(None)
    book._dense = level
    judge = TrustJudge(TrustSettings(), signals, None, book=book)
    stats = GenerationStats(
        text="ok", level="dense", calibration_version=None, prompt_tokens=8,
        completion_tokens=4, finish_reason="stop", time_to_first_token_s=0.0,
        decode_tokens_per_s=1.0, prefill_tokens_per_s=1.0, input_entropy_bits_per_char=4.0,
        signals=SignalSummary(
            sparsity_ratio=0.0, sparsity_per_layer=[0.0] * 6, gate_confidence=1.0,
            activation_stability_pct=0.0, silence_rate_per_layer=[0.45] * 6, step_sparsity=[],
            gate_entropy=0.5,
        ),
    )  # fmt: skip
    code = "def f(x):\n    y = x * 2\n    return y\n\nprint(f(3))"
    spoken = judge.assess(stats, f"Be brief.\n{code}", True, user_text="Hello there.")
    assert REASON_SILENCE_SPIKE in spoken.reasons
    written = judge.assess(stats, "Be brief.", True, user_text=code)
    assert REASON_SILENCE_SPIKE not in written.reasons


def test_reasons_use_the_pooled_sample_where_a_kind_is_too_small_for_the_budget() -> None:
    signals = SignalSettings()  # 1 % budget: each kind needs 99 requests
    rng = random.Random(2)
    small = baseline_of({"late_silence": [rng.uniform(0.1, 0.2) for _ in range(120)]}, kinds=4)
    assert len(small.signals["late_silence"].kind_values["k0"]) + 1 < 1 / signals.reason_budget
    odd = RequestSignals(silence_per_layer=[0.9] * 6, gate_confidence=0.5, gate_entropy=0.5)
    assert trust_reasons(odd, 1.0, signals, 0.3, baseline=small) == (REASON_SILENCE_SPIKE,)


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
    scores = set_flag_threshold(model, healthy, 0.05, "chat", "balanced")
    threshold = model.flag_thresholds["balanced"]
    assert model.flag_fit["balanced"]["requests"] == 199
    assert sum(s < threshold for s in scores) <= 0.05 * 200
    held_out = [model.score(answer(rng.random() < 0.8)) for _ in range(2000)]
    assert sum(s < threshold for s in held_out) / 2000 <= 0.05 + 0.05
    # A sparser level's healthy answers score lower: their own threshold, not balanced's.
    worse = [answer(rng.random() < 0.5) for _ in range(199)]
    set_flag_threshold(model, worse, 0.05, "chat", "aggressive")
    assert model.flag_thresholds["aggressive"] < threshold
    judge = TrustJudge(TrustSettings(min_score=0.3), SignalSettings(), model)
    assert judge.flag_below(model, None, "aggressive") == model.flag_thresholds["aggressive"]
    assert judge.flag_below(model, None, "conservative") == 0.3  # none measured there
    reloaded = TrustModel.from_dict(model.to_dict())
    assert reloaded.flag_thresholds == model.flag_thresholds


def test_the_rule_score_flags_within_the_budget_of_the_baselines_late_silence() -> None:
    """Without a trust model the score is 1 - late-band silence; its flag threshold follows
    the same budget on the baseline's late-band silence."""
    judge = TrustJudge(TrustSettings(flag_budget=0.05), SignalSettings(), None)
    healthy = healthy_level()  # late-band silence uniform on [0.80, 0.90], 200 requests
    floor = judge.flag_below(None, healthy, "balanced")
    assert 1 - 0.90 < floor < 1 - 0.89  # only the top ~5 % of healthy silence is flagged
    no_baseline = judge.flag_below(None, None, "balanced")
    assert no_baseline == TrustSettings().min_score  # no baseline: the fallback
    # Each kind of the request's category at its budget: code's louder late layers set code's
    # threshold, the quiet kinds' theirs (the pooled threshold flagged code alone).
    rng = random.Random(12)
    by_kind = {"code": [rng.uniform(0.5, 0.9) for _ in range(100)]}
    by_kind |= {k: [rng.uniform(0.1, 0.3) for _ in range(100)] for k in ("a", "b")}
    level = LevelBaseline("balanced", 300, sorted(by_kind), 16,
                          {"late_silence": SignalBaseline.of(by_kind)})  # fmt: skip
    pooled = judge.flag_below(None, level.pooled(), "balanced")
    code = judge.flag_below(None, level, "balanced", ["code"])
    text = judge.flag_below(None, level, "balanced", ["a", "b"])
    assert judge.flag_below(None, level, "balanced") == code  # every kind: the loudest's
    assert 1 - 0.3 < text < 1 - 0.28 and 1 - 0.9 < code < 1 - 0.86
    fresh_code = [rng.uniform(0.5, 0.9) for _ in range(4000)]
    share = sum(1 - v < code for v in fresh_code) / 4000
    assert share <= 0.05 + 3 * math.sqrt(0.05 / 100)
    assert sum(1 - v < pooled for v in fresh_code) / 4000 > 2 * share  # the pool's 5 %: code's
