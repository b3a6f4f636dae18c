"""Request policy: one test per rule, the boundaries, and properties over valid inputs."""

from __future__ import annotations

import math
import string
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.gateway.policy import (
    PolicyDecision,
    PolicyInput,
    decide,
    header_value,
    level_for_entropy,
)
from sparse_engine.sparsity.plan import Level

# Equal counts of 2**k distinct characters give exactly k bits/char.
THREE_BITS = string.ascii_lowercase[:8] * 4
FOUR_BITS = string.ascii_lowercase[:16] * 2
FIVE_BITS = (string.ascii_lowercase + "012345")[:32]
LONG_SYSTEM = "s" * 201
# How much work each level skips, in order.
SPARSENESS = [Level.DENSE, Level.CONSERVATIVE, Level.BALANCED, Level.AGGRESSIVE]


def _input(**overrides: object) -> PolicyInput:
    base = PolicyInput(
        user_text="hello",
        system_text="",
        requested_level=None,
        ir_sparse=None,
        max_tokens=100,
        temperature=0.7,
    )
    return replace(base, **overrides)  # type: ignore[arg-type]


def test_explicit_level_is_kept_without_changes() -> None:
    decision = decide(_input(requested_level="Aggressive"))
    assert decision == PolicyDecision(Level.AGGRESSIVE, 100, 0.7, ())


def test_missing_level_takes_default_without_a_change() -> None:
    assert decide(_input()).level is Level.BALANCED
    assert decide(_input(ir_sparse=True, default_level="conservative")).changes == ()
    assert decide(_input(ir_sparse=True, default_level="conservative")).level is Level.CONSERVATIVE


def test_missing_max_tokens_and_temperature_take_defaults_silently() -> None:
    decision = decide(_input(max_tokens=None, temperature=None, default_max_tokens=321))
    assert (decision.max_tokens, decision.temperature, decision.changes) == (321, 1.0, ())


@pytest.mark.parametrize(
    ("text", "level"),
    [(THREE_BITS, Level.CONSERVATIVE), (FOUR_BITS, Level.BALANCED), (FIVE_BITS, Level.AGGRESSIVE)],
)
def test_auto_picks_by_entropy(text: str, level: Level) -> None:
    decision = decide(_input(requested_level="auto", user_text=text))
    assert decision.level is level
    bits = {Level.CONSERVATIVE: "3.00", Level.BALANCED: "4.00", Level.AGGRESSIVE: "5.00"}[level]
    assert decision.changes == (f"level:auto->{level.value}(entropy={bits})",)


def test_auto_as_default_level_is_reported() -> None:
    decision = decide(_input(default_level="auto", user_text=FOUR_BITS))
    assert decision.changes == ("level:auto->balanced(entropy=4.00)",)


def test_entropy_boundaries_belong_to_balanced() -> None:
    assert level_for_entropy(math.nextafter(3.2, 0.0)) is Level.CONSERVATIVE
    assert level_for_entropy(3.2) is Level.BALANCED
    assert level_for_entropy(4.1) is Level.BALANCED
    assert level_for_entropy(math.nextafter(4.1, math.inf)) is Level.AGGRESSIVE


def test_empty_user_text_under_auto_is_conservative() -> None:
    assert decide(_input(requested_level="auto", user_text="")).level is Level.CONSERVATIVE


@pytest.mark.parametrize(
    ("level", "stepped"),
    [
        ("aggressive", Level.BALANCED),
        ("balanced", Level.CONSERVATIVE),
        ("conservative", Level.CONSERVATIVE),
        ("dense", Level.DENSE),
    ],
)
def test_long_system_prompt_steps_one_level_down(level: str, stepped: Level) -> None:
    decision = decide(_input(requested_level=level, system_text=LONG_SYSTEM))
    assert decision.level is stepped
    expected = (
        () if stepped.value == level else (f"level:{level}->{stepped.value}(system_prompt>200)",)
    )
    assert decision.changes == expected


def test_system_prompt_of_exactly_200_chars_does_not_step_down() -> None:
    assert decide(_input(requested_level="balanced", system_text="s" * 200)).changes == ()


def test_auto_then_system_prompt_reports_both_in_order() -> None:
    decision = decide(_input(requested_level="auto", user_text=FIVE_BITS, system_text=LONG_SYSTEM))
    assert decision.level is Level.BALANCED
    assert decision.changes == (
        "level:auto->aggressive(entropy=5.00)",
        "level:aggressive->balanced(system_prompt>200)",
    )


def test_aggressive_caps_max_tokens() -> None:
    decision = decide(_input(requested_level="aggressive", max_tokens=4096))
    assert (decision.max_tokens, decision.changes) == (2048, ("max_tokens:4096->2048",))


def test_cap_boundary_and_other_levels_are_not_capped() -> None:
    assert decide(_input(requested_level="aggressive", max_tokens=2048)).changes == ()
    assert decide(_input(requested_level="balanced", max_tokens=4096)).max_tokens == 4096


def test_aggressive_caps_a_large_default_too() -> None:
    decision = decide(
        _input(requested_level="aggressive", max_tokens=None, default_max_tokens=3000)
    )
    assert (decision.max_tokens, decision.changes) == (2048, ("max_tokens:3000->2048",))


def test_zero_temperature_is_raised_for_sparse_levels_only_when_turned_on() -> None:
    on = decide(
        _input(requested_level="conservative", temperature=0.0, raise_zero_temperature=True)
    )
    assert (on.temperature, on.changes) == (0.3, ("temperature:0->0.3",))
    default = decide(_input(requested_level="balanced", temperature=0.0))
    assert (default.temperature, default.changes) == (0.0, ())  # greedy stays greedy


def test_zero_temperature_stays_when_dense_even_when_turned_on() -> None:
    dense = _input(requested_level="dense", temperature=0.0, raise_zero_temperature=True)
    assert decide(dense).temperature == 0.0


def test_ir_sparse_false_forces_dense_and_reports_an_explicit_level() -> None:
    decision = decide(_input(requested_level="balanced", ir_sparse=False, temperature=0.0))
    assert decision == PolicyDecision(
        Level.DENSE, 100, 0.0, ("level:balanced->dense(ir_sparse=false)",)
    )


def test_ir_sparse_false_overrides_auto_and_is_reported() -> None:
    decision = decide(_input(requested_level="auto", ir_sparse=False))
    assert decision.changes == ("level:auto->dense(ir_sparse=false)",)


def test_ir_sparse_false_without_a_level_is_silent() -> None:
    assert decide(_input(ir_sparse=False)) == PolicyDecision(Level.DENSE, 100, 0.7, ())
    assert decide(_input(ir_sparse=False, requested_level="dense")).changes == ()


def test_every_rule_reports_in_order() -> None:
    decision = decide(
        _input(
            requested_level="auto",
            user_text=FIVE_BITS,
            system_text=LONG_SYSTEM,
            default_level="conservative",
            max_tokens=9000,
            temperature=0,
            aggressive_max_tokens=10,
            raise_zero_temperature=True,
        )
    )
    assert decision.changes == (
        "level:auto->aggressive(entropy=5.00)",
        "level:aggressive->balanced(system_prompt>200)",
        "temperature:0->0.3",
    )


def test_unknown_level_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="dense, conservative, balanced, aggressive, auto"):
        decide(_input(requested_level="turbo"))
    with pytest.raises(ValueError, match="unknown level 'turbo'"):
        decide(_input(default_level="turbo"))


@pytest.mark.parametrize(
    "overrides",
    [{"max_tokens": 0}, {"temperature": -0.1}, {"temperature": math.nan}],
)
def test_invalid_sampling_settings_raise(overrides: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="must be"):
        decide(_input(**overrides))


def test_header_value() -> None:
    assert header_value(()) == "none"
    assert header_value([""]) == "none"
    changes = ("level:auto->balanced(entropy=3.62)", "max_tokens:4096->2048")
    assert header_value(changes) == "level:auto->balanced(entropy=3.62), max_tokens:4096->2048"


def test_header_value_escapes_what_a_header_cannot_carry() -> None:
    assert header_value(["a,b%c\né"]) == "a%2Cb%25c%0A%C3%A9"


@given(st.lists(st.text(), max_size=4))
def test_header_value_is_printable_ascii(changes: list[str]) -> None:
    value = header_value(changes)
    assert value and all(" " <= ch <= "~" for ch in value)


_levels = st.sampled_from([None, "dense", "conservative", "balanced", "aggressive", "auto"])
_policy_inputs = st.builds(
    PolicyInput,
    user_text=st.text(max_size=300),
    system_text=st.text(max_size=300),
    requested_level=_levels,
    ir_sparse=st.sampled_from([None, True, False]),
    max_tokens=st.one_of(st.none(), st.integers(1, 100_000)),
    temperature=st.one_of(st.none(), st.just(0.0), st.floats(0.0, 2.0)),
    default_level=st.sampled_from(["dense", "conservative", "balanced", "aggressive", "auto"]),
    raise_zero_temperature=st.booleans(),
)


@given(_policy_inputs)
def test_decide_on_valid_input_never_raises_and_caps_aggressive(p: PolicyInput) -> None:
    decision = decide(p)
    if decision.level is Level.AGGRESSIVE:
        assert decision.max_tokens <= 2048


@given(_policy_inputs)
def test_level_is_never_sparser_than_asked_except_via_auto(p: PolicyInput) -> None:
    asked = p.requested_level if p.requested_level is not None else p.default_level
    decision = decide(p)
    if p.ir_sparse is False:
        assert decision.level is Level.DENSE
    elif asked != "auto":
        assert SPARSENESS.index(decision.level) <= SPARSENESS.index(Level.parse(asked))


@given(_policy_inputs)
def test_nothing_changes_silently(p: PolicyInput) -> None:
    decision = decide(p)
    max_tokens = p.default_max_tokens if p.max_tokens is None else p.max_tokens
    temperature = 1.0 if p.temperature is None else p.temperature
    kinds = {change.split(":", 1)[0] for change in decision.changes}
    assert ("max_tokens" in kinds) == (decision.max_tokens != max_tokens)
    assert ("temperature" in kinds) == (decision.temperature != temperature)
    asked = p.requested_level if p.requested_level is not None else p.default_level
    opted_out = p.ir_sparse is False and p.requested_level is None  # the caller's own choice
    if asked != "auto" and not opted_out and decision.level is not Level.parse(asked):
        assert "level" in kinds
