"""Input hygiene applied before the model sees a prompt: Unicode NFKC, control-character
stripping and number normalisation (`1,000` -> `1000`, `3.5亿` -> `350000000`).

`clean_text` is idempotent: cleaning its output again changes nothing and reports no flags.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from decimal import MAX_EMAX, MIN_EMIN, Decimal, Inexact, localcontext
from itertools import pairwise

FLAG_NFKC = "nfkc"
FLAG_CONTROL_CHARS = "control_chars"
FLAG_NUMBERS = "numbers"

# Control characters that end a line (as str.splitlines sees them) become "\n" rather than
# vanishing, so "a\fb" keeps two words; "\r\n" is one line break, not two.
_LINE_BREAKS = re.compile("\r\n|[\r\x0b\x0c\x85]")
_KEPT_CONTROLS = frozenset("\n\t")

# Powers of ten for Chinese magnitude suffixes (simplified and traditional forms).
# 兆 is left out on purpose: it means 10^6 in mainland metric usage and 10^12 elsewhere.
_MAGNITUDES: dict[str, int] = {"百": 2, "千": 3, "万": 4, "萬": 4, "亿": 8, "億": 8}
_SUFFIX = "[" + "".join(_MAGNITUDES) + "]"
_NUMBER = r"[0-9]+(?:\.[0-9]+)?"
# Not inside another number: no digit, and no "digit." / "digit," right before the start.
_NOT_AFTER_NUMBER = r"(?<!\d)(?<!\d[.,])"

# 1,000 and 12,345,678: every group after a comma has exactly three digits, and the number
# does not go on with more digits or another ",digit" (so "1,0000" and "1,000,00" stay).
_GROUPED = re.compile(_NOT_AFTER_NUMBER + r"[0-9]{1,3}(?:,[0-9]{3})+(?!\d|,\d)")
# 3.5亿, 1万亿 (suffixes multiply) and 1亿2000万 (terms with falling magnitude add up).
# A chain followed by a digit ("1万5", colloquial 15000) is ambiguous and left alone.
_TERM = _NUMBER + _SUFFIX + "+"
_MAGNITUDE_CHAIN = re.compile(_NOT_AFTER_NUMBER + f"(?:{_TERM})+" + rf"(?!\d|[.,]\d|{_SUFFIX})")
_TERM_PARTS = re.compile(f"({_NUMBER})({_SUFFIX}+)")


@dataclass(frozen=True, slots=True)
class Cleaned:
    """The cleaned text and the names of the rules that changed it (empty: unchanged)."""

    text: str
    flags: tuple[str, ...]


def clean_text(text: str) -> Cleaned:
    """Apply NFKC, control-character stripping and number normalisation, in that order."""
    normalised = unicodedata.normalize("NFKC", text)
    stripped = strip_control_chars(normalised)
    # Removing a control character can bring a base letter and a combining mark together;
    # normalise again so the output is NFKC whatever was removed.
    renormalised = unicodedata.normalize("NFKC", stripped)
    numbers = normalise_numbers(renormalised)
    flags = (
        (FLAG_NFKC, normalised != text or renormalised != stripped),
        (FLAG_CONTROL_CHARS, stripped != normalised),
        (FLAG_NUMBERS, numbers != renormalised),
    )
    return Cleaned(text=numbers, flags=tuple(name for name, changed in flags if changed))


def strip_control_chars(text: str) -> str:
    """Turn line-ending controls into "\\n" and drop every other Unicode Cc character except
    "\\n" and "\\t". Format characters (Cf: zero-width joiners, bidi marks) are kept: they
    carry meaning in emoji sequences and in Persian and Indic scripts."""
    unified = _LINE_BREAKS.sub("\n", text)
    return "".join(ch for ch in unified if ch in _KEPT_CONTROLS or not _is_control(ch))


def normalise_numbers(text: str) -> str:
    """Drop thousands separators, then expand Chinese magnitude suffixes exactly."""
    ungrouped = _GROUPED.sub(lambda m: m.group().replace(",", ""), text)
    return _MAGNITUDE_CHAIN.sub(lambda m: _expand_chain(m.group()), ungrouped)


def _is_control(ch: str) -> bool:
    return unicodedata.category(ch) == "Cc"


def _expand_chain(chain: str) -> str:
    """The value of "1亿2000万"-style text as a plain decimal, or the chain unchanged when its
    terms do not fall in magnitude ("2万3万" is not a number)."""
    terms = [(number, _exponent(suffixes)) for number, suffixes in _TERM_PARTS.findall(chain)]
    exponents = [exponent for _, exponent in terms]
    if any(later >= earlier for earlier, later in pairwise(exponents)):
        return chain
    return _plain(_exact_sum(terms, precision=8 * len(chain) + 16))


def _exponent(suffixes: str) -> int:
    return sum(_MAGNITUDES[suffix] for suffix in suffixes)


def _exact_sum(terms: list[tuple[str, int]], precision: int) -> Decimal:
    """Sum of number * 10**exponent. `precision` bounds the digits of any result, so the
    arithmetic is exact; Inexact is trapped so a wrong bound fails loudly, not silently."""
    with localcontext() as ctx:
        ctx.prec = precision
        ctx.Emax, ctx.Emin = MAX_EMAX, MIN_EMIN
        ctx.traps[Inexact] = True
        return sum((Decimal(number).scaleb(exponent) for number, exponent in terms), Decimal(0))


def _plain(value: Decimal) -> str:
    """Positional notation with no exponent and no trailing fractional zeros."""
    text = format(value, "f")
    return text.rstrip("0").rstrip(".") if "." in text else text
