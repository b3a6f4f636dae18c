"""Prometheus-style durations ("30s", "5m", "1h30m", "26h") to seconds and back."""

from __future__ import annotations

import re

UNITS_S: dict[str, float] = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
_PART = re.compile(r"(\d+)(ms|s|m|h|d)")
_WHOLE = re.compile(r"(?:\d+(?:ms|s|m|h|d))+")


def parse_duration(text: str) -> float:
    """Seconds in `text`, a sequence of integer + unit parts (ms, s, m, h, d), largest first."""
    if not _WHOLE.fullmatch(text):
        raise ValueError(
            f"bad duration {text!r}: use an integer and a unit, e.g. '30s', '5m', '1h'"
        )
    parts = _PART.findall(text)
    order = [list(UNITS_S).index(unit) for _, unit in parts]
    if order != sorted(set(order)):
        raise ValueError(f"bad duration {text!r}: give each unit once, largest first ('1h30m')")
    return sum(int(amount) * UNITS_S[unit] for amount, unit in parts)


def format_duration(seconds: float) -> str:
    """The shortest Prometheus duration for `seconds` (whole milliseconds), e.g. 5400 -> '1h30m'."""
    if seconds < 0:
        raise ValueError(f"duration must be >= 0, got {seconds}")
    left = round(seconds * 1000)
    parts = []
    for unit, size_s in UNITS_S.items():
        size = round(size_s * 1000)
        amount, left = divmod(left, size)
        if amount:
            parts.append(f"{amount}{unit}")
    return "".join(parts) or "0s"
