"""Request policy: which sparsity level a request runs at and which sampling settings it
gets, with every change reported back to the caller (mission.md, "Levels").

Rules, applied in this order:
1. `ir_sparse=False` forces dense; otherwise the requested level, or `default_level` when
   none is given. `auto` picks by the Shannon entropy of the user text (bits/char):
   below 3.2 conservative, 3.2 to 4.1 inclusive balanced, above 4.1 aggressive.
2. A system prompt longer than 200 characters steps a sparse level one step towards dense
   (aggressive -> balanced -> conservative; conservative and dense stay).
3. `aggressive` caps max_tokens (2048 by default).
4. Only when turned on (off by default: temperature 0 means greedy): a sparse level with
   temperature 0 is raised to 0.3.
Missing max_tokens and temperature take their defaults; filling a default is not a change.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

from sparse_engine.sparsity.plan import Level
from sparse_engine.sparsity.signals import entropy_bits_per_char

AUTO: Final = "auto"
CONSERVATIVE_BELOW_BITS = 3.2
AGGRESSIVE_ABOVE_BITS = 4.1
LONG_SYSTEM_PROMPT_CHARS = 200
RAISED_TEMPERATURE = 0.3
AGGRESSIVE_MAX_TOKENS = 2048
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default when the request leaves it out
NO_CHANGES = "none"

# The next less sparse level: a long system prompt steps the level down by one.
_STEP_DOWN = {Level.AGGRESSIVE: Level.BALANCED, Level.BALANCED: Level.CONSERVATIVE}
# A parsed level request: a fixed level, or "auto" (pick by input entropy).
LevelChoice = Level | Literal["auto"]
_VALID_LEVELS = ", ".join([*(level.value for level in Level), AUTO])
# Printable ASCII except the list separator and the escape character itself.
_HEADER_SAFE = frozenset(map(chr, range(0x20, 0x7F))) - {",", "%"}


@dataclass(frozen=True, slots=True)
class PolicyInput:
    """What a request asked for, plus the service's policy settings."""

    user_text: str
    system_text: str
    requested_level: str | None
    ir_sparse: bool | None
    max_tokens: int | None
    temperature: float | None
    default_level: str = "balanced"
    raise_zero_temperature: bool = False
    aggressive_max_tokens: int = AGGRESSIVE_MAX_TOKENS
    default_max_tokens: int = 256


@dataclass(frozen=True, slots=True)
class PolicyDecision:
    """What the request will run with; `changes` lists every override, in order applied."""

    level: Level
    max_tokens: int
    temperature: float
    changes: tuple[str, ...]


def decide(p: PolicyInput) -> PolicyDecision:
    """Apply the policy rules. Raises ValueError for an unknown level, max_tokens below 1,
    or a negative or non-finite temperature."""
    requested = parse_level(p.requested_level) if p.requested_level is not None else None
    default = parse_level(p.default_level)
    max_tokens = _checked_max_tokens(p.max_tokens, p.default_max_tokens)
    temperature = _checked_temperature(p.temperature)
    level, changes = _initial_level(requested, default, p.ir_sparse, p.user_text)
    level, change = _step_down_for_system_prompt(level, p.system_text)
    max_tokens, cap_change = _cap_max_tokens(level, max_tokens, p.aggressive_max_tokens)
    temperature, temp_change = _raise_temperature(level, temperature, p.raise_zero_temperature)
    optional = (change, cap_change, temp_change)
    return PolicyDecision(
        level=level,
        max_tokens=max_tokens,
        temperature=temperature,
        changes=(*changes, *(c for c in optional if c is not None)),
    )


def parse_level(value: str) -> LevelChoice:
    """A Level, or AUTO; ValueError naming the valid values otherwise."""
    if value.strip().lower() == AUTO:
        return AUTO
    try:
        return Level.parse(value)
    except ValueError:
        raise ValueError(f"unknown level '{value}'; choose one of: {_VALID_LEVELS}") from None


def level_for_entropy(bits_per_char: float) -> Level:
    """The auto level for an input entropy; both boundaries belong to balanced."""
    if bits_per_char < CONSERVATIVE_BELOW_BITS:
        return Level.CONSERVATIVE
    if bits_per_char > AGGRESSIVE_ABOVE_BITS:
        return Level.AGGRESSIVE
    return Level.BALANCED


def header_value(changes: Sequence[str]) -> str:
    """The `X-IR-Policy` header: non-empty changes joined by ", ", or "none". Anything outside
    printable ASCII, and "," and "%", is percent-encoded as UTF-8 so the value is header-safe
    and still splits cleanly on commas."""
    encoded = [_header_safe(change) for change in changes if change]
    return ", ".join(encoded) if encoded else NO_CHANGES


def _initial_level(
    requested: LevelChoice | None, default: LevelChoice, ir_sparse: bool | None, user_text: str
) -> tuple[Level, tuple[str, ...]]:
    if ir_sparse is False:
        return Level.DENSE, _forced_dense_change(requested)
    chosen = default if requested is None else requested
    if isinstance(chosen, Level):
        return chosen, ()
    entropy = entropy_bits_per_char(user_text)
    level = level_for_entropy(entropy)
    return level, (f"level:{AUTO}->{level.value}(entropy={entropy:.2f})",)


def _forced_dense_change(requested: LevelChoice | None) -> tuple[str, ...]:
    """Only an explicitly requested sparse level (or auto) was overridden; the default was
    never asked for and dense needs no change."""
    if requested is None or requested == Level.DENSE:
        return ()
    name = requested.value if isinstance(requested, Level) else requested
    return (f"level:{name}->{Level.DENSE.value}(ir_sparse=false)",)


def _step_down_for_system_prompt(level: Level, system_text: str) -> tuple[Level, str | None]:
    lower = _STEP_DOWN.get(level)
    if lower is None or len(system_text) <= LONG_SYSTEM_PROMPT_CHARS:
        return level, None
    reason = f"system_prompt>{LONG_SYSTEM_PROMPT_CHARS}"
    return lower, f"level:{level.value}->{lower.value}({reason})"


def _cap_max_tokens(level: Level, max_tokens: int, cap: int) -> tuple[int, str | None]:
    if level is not Level.AGGRESSIVE or max_tokens <= cap:
        return max_tokens, None
    return cap, f"max_tokens:{max_tokens}->{cap}"


def _raise_temperature(level: Level, temperature: float, enabled: bool) -> tuple[float, str | None]:
    if not enabled or level is Level.DENSE or temperature != 0:
        return temperature, None
    return RAISED_TEMPERATURE, f"temperature:{temperature:g}->{RAISED_TEMPERATURE:g}"


def _checked_max_tokens(max_tokens: int | None, default: int) -> int:
    value = default if max_tokens is None else max_tokens
    if value < 1:
        raise ValueError(f"max_tokens must be a positive integer, got {value}")
    return value


def _checked_temperature(temperature: float | None) -> float:
    value = DEFAULT_TEMPERATURE if temperature is None else temperature
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {value}")
    return value


def _header_safe(change: str) -> str:
    return "".join(ch if ch in _HEADER_SAFE else _percent_encoded(ch) for ch in change)


def _percent_encoded(ch: str) -> str:
    return "".join(f"%{byte:02X}" for byte in ch.encode("utf-8", "surrogatepass"))
