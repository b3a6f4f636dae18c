"""Input hygiene: one example per rule, and properties of clean_text on arbitrary text."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from services.gateway.hygiene import Cleaned, clean_text

FULLWIDTH_1000 = "\uff11\uff0c\uff10\uff10\uff10"  # "1,000" in fullwidth digits and comma

# Text built from the characters the rules act on, so Hypothesis reaches them often.
_RULE_ALPHABET = st.sampled_from(
    [
        *"0123456789,.,. 万亿千百萬億兆米e\n\t\r\x00\x0b\x0c\x1b\x7f\x85\u0301\u200b",
        *"\uff11\uff0c\uff45\ufb01",  # fullwidth 1, fullwidth comma, fullwidth e, "fi" ligature
        "\r\n",
    ]
)
_texts = st.one_of(st.text(), st.lists(_RULE_ALPHABET, max_size=40).map("".join))


def _is_forbidden_control(ch: str) -> bool:
    return unicodedata.category(ch) == "Cc" and ch not in "\n\t"


@given(_texts)
@example("e\x00\u0301")
@example("1,000,000万1,000")
@settings(max_examples=600)
def test_clean_is_idempotent(text: str) -> None:
    once = clean_text(text)
    assert clean_text(once.text) == Cleaned(text=once.text, flags=())


@given(_texts)
@settings(max_examples=300)
def test_output_is_nfkc_with_no_control_chars_but_newline_and_tab(text: str) -> None:
    cleaned = clean_text(text).text
    assert unicodedata.is_normalized("NFKC", cleaned)
    assert not any(_is_forbidden_control(ch) for ch in cleaned)


@given(_texts)
@settings(max_examples=300)
def test_flags_are_empty_exactly_when_text_is_unchanged(text: str) -> None:
    cleaned = clean_text(text)
    assert (cleaned.flags == ()) == (cleaned.text == text)


@given(st.text(alphabet=st.characters(codec=None, exclude_categories=())))
def test_arbitrary_text_never_raises(text: str) -> None:
    assert isinstance(clean_text(text).text, str)


def test_nfkc_folds_compatibility_characters() -> None:
    assert clean_text("\ufb01le \uff21\uff22\uff23") == Cleaned("file ABC", ("nfkc",))


def test_control_chars_are_stripped_but_newline_and_tab_kept() -> None:
    assert clean_text("a\x00b\x1bc\x7fd\te\nf") == Cleaned("abcd\te\nf", ("control_chars",))


def test_carriage_returns_become_newlines() -> None:
    assert clean_text("a\r\nb\rc").text == "a\nb\nc"


def test_line_ending_controls_become_newlines_not_nothing() -> None:
    assert clean_text("a\x0bb\x0cc\x85d").text == "a\nb\nc\nd"


def test_format_characters_are_kept() -> None:
    family = "\U0001f468\u200d\U0001f469\u200d\U0001f467"
    assert clean_text(family) == Cleaned(family, ())


def test_stripping_a_control_char_renormalises_what_it_separated() -> None:
    assert clean_text("e\x00\u0301") == Cleaned("\u00e9", ("nfkc", "control_chars"))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1,000", "1000"),
        ("12,345,678.9", "12345678.9"),
        ("pay 1,000,000 now", "pay 1000000 now"),
        (FULLWIDTH_1000, "1000"),
    ],
)
def test_thousands_separators_are_dropped(text: str, expected: str) -> None:
    assert clean_text(text).text == expected
    assert "numbers" in clean_text(text).flags


@pytest.mark.parametrize(
    "text", ["1,2", "1, 2, 3", "1,0000", "1,000,00", "12,34", "0.1,000", "3,1,000", "a,b"]
)
def test_malformed_groups_and_lists_stay(text: str) -> None:
    assert clean_text(text) == Cleaned(text, ())


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3.5亿", "350000000"),
        ("2万", "20000"),
        ("1.2千", "1200"),
        ("5百", "500"),
        ("1万亿", "1000000000000"),
        ("3百万", "3000000"),
        ("1亿2000万", "120000000"),
        ("2万3千", "23000"),
        ("1,000万", "10000000"),
        ("1.23456百", "123.456"),
        ("0.00001万", "0.1"),
        ("0.0万", "0"),
        ("2萬", "20000"),
        ("收入-2.5万元", "收入-25000元"),
    ],
)
def test_chinese_magnitudes_expand_exactly(text: str, expected: str) -> None:
    assert clean_text(text) == Cleaned(expected, ("numbers",))


def test_magnitude_is_exact_beyond_float_precision() -> None:
    digits = "1234567890123456789.123456789"
    assert clean_text(digits + "亿").text == "123456789012345678912345678.9"


@pytest.mark.parametrize(
    "text", ["1万5", "1万亿5", "2万3万", "1百,500", "万", "百分之5", "v1.2.3万"]
)
def test_ambiguous_or_non_numeric_magnitudes_stay(text: str) -> None:
    assert clean_text(text) == Cleaned(text, ())


def test_rules_report_in_order() -> None:
    assert clean_text(FULLWIDTH_1000 + "\x00").flags == ("nfkc", "control_chars", "numbers")


def test_plain_text_is_untouched() -> None:
    text = "Hello, world: 3 apples, 4.5 pears, 1, 2, 3.\n\tDone."
    assert clean_text(text) == Cleaned(text, ())
