"""Annotation placeholders: the small subset of Prometheus' Go templates that both
Prometheus and our in-process evaluator render the same way.

Supported: `{{ $labels.NAME }}`, `{{ $value }}` and `{{ printf "%.Nf" $value }}` (N a digit)."""

from __future__ import annotations

import re
from collections.abc import Mapping

_PLACEHOLDER = re.compile(r"\{\{\s*(.*?)\s*\}\}")
_LABEL = re.compile(r"\$labels\.([A-Za-z_][A-Za-z0-9_]*)")
_PRINTF = re.compile(r'printf\s+"%\.(\d)f"\s+\$value')
SUPPORTED = '{{ $labels.NAME }}, {{ $value }}, {{ printf "%.2f" $value }}'


def check_template(text: str) -> None:
    """Raise ValueError naming the first placeholder outside the supported subset."""
    rest = _PLACEHOLDER.sub("", text)
    if "{{" in rest or "}}" in rest:
        raise ValueError(f"unbalanced '{{{{' or '}}}}' in {text!r}")
    for match in _PLACEHOLDER.finditer(text):
        inner = match.group(1)
        if not (inner == "$value" or _LABEL.fullmatch(inner) or _PRINTF.fullmatch(inner)):
            raise ValueError(f"unsupported placeholder {match.group(0)!r}; use {SUPPORTED}")


def render(text: str, labels: Mapping[str, str], value: float | None) -> str:
    """`text` with its placeholders filled; a missing label or value renders as ''."""

    def fill(match: re.Match[str]) -> str:
        inner = match.group(1)
        label = _LABEL.fullmatch(inner)
        if label:
            return labels.get(label.group(1), "")
        if value is None:
            return ""
        printf = _PRINTF.fullmatch(inner)
        return f"{value:.{printf.group(1)}f}" if printf else format_value(value)

    return _PLACEHOLDER.sub(fill, text)


def render_all(
    annotations: Mapping[str, str], labels: Mapping[str, str], value: float | None
) -> dict[str, str]:
    return {name: render(text, labels, value) for name, text in annotations.items()}


def format_value(value: float) -> str:
    """Close to Go's %v for float64: integers without a decimal point."""
    return str(int(value)) if value.is_integer() and abs(value) < 1e21 else repr(value)
