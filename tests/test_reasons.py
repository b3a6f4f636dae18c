"""Per-request reasons against a healthy baseline: each kind's own sample, on the request's
side of the system prompt, among the kinds of its category, past the rank that holds the
budget; and the rule score's flag threshold, set the same way."""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime

import pytest

from services.config import SignalSettings, TrustSettings
from services.gateway.reasons import BaselineBook, trust_reasons
from services.gateway.trust import TrustJudge
from services.telemetry.schema import (
    REASON_GATE_DEGRADED,
    REASON_MONOTONOUS_INPUT,
    REASON_SILENCE_SPIKE,
)
from sparse_engine.calibration.baseline import LevelBaseline, SignalBaseline
from sparse_engine.runtime.generation import GenerationStats
from sparse_engine.sparsity.recorder import SignalSummary
from sparse_engine.trust.features import RequestSignals
from tests.baseline_fixtures import baseline_of, healthy_level

NOW = datetime(2026, 1, 1, tzinfo=UTC)


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
