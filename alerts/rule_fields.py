"""One reader per field of a rule: each takes the field's YAML node (or entry, when the field
is optional), checks it and returns the typed value, or raises `RuleError` at its line."""

from __future__ import annotations

import re

import yaml

from alerts.definitions import (
    ACTIONS,
    BASELINE_SIGNALS,
    OPS,
    PIPELINE_METRICS,
    RESERVED_LABELS,
    SEVERITIES,
    WINDOW_METRICS,
    WINDOWS,
    Band,
    Deviation,
    Op,
    Relative,
    Severity,
    Signals,
    Threshold,
)
from alerts.durations import parse_duration
from alerts.templates import check_template
from alerts.yaml_nodes import Entry, Reader

RELATIVE_KEYS = ("relative_to", "factor", "default")
BASELINE_KEY = "baseline"
DEVIATION_KEYS = (BASELINE_KEY, "z", "count")
SIGNAL_KEY = "signal"
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def read_name(reader: Reader, node: yaml.Node) -> str:
    name = reader.string(node, "'name'")
    if not NAME.fullmatch(name):
        raise reader.error(node, f"bad rule name {name!r}: use letters, digits and '_'")
    return name


def read_metric(reader: Reader, node: yaml.Node, what: str) -> str:
    metric = reader.string(node, f"{what} 'metric'")
    if metric not in WINDOW_METRICS + PIPELINE_METRICS:
        raise reader.error(
            node,
            f"{what}: unknown metric {metric!r} (window metrics: {', '.join(WINDOW_METRICS)};"
            f" pipeline metrics: {', '.join(PIPELINE_METRICS)})",
        )
    return metric


def read_window(
    reader: Reader, entry: Entry | None, rule: yaml.Node, metric: str, what: str
) -> str | None:
    if metric in PIPELINE_METRICS:
        if entry is not None and not reader.is_null(entry[1]):
            raise reader.error(entry[0], f"{what}: {metric!r} has no window: remove 'window'")
        return None
    if entry is None:
        raise reader.error(rule, f"{what}: missing field 'window' (one of {', '.join(WINDOWS)})")
    window = reader.string(entry[1], f"{what} 'window'")
    if window not in WINDOWS:
        raise reader.error(entry[1], f"{what}: bad window {window!r} (one of {', '.join(WINDOWS)})")
    return window


def read_op(reader: Reader, node: yaml.Node, what: str) -> Op:
    op = reader.string(node, f"{what} 'op'")
    for known in OPS:
        if op == known:
            return known
    raise reader.error(node, f"{what}: bad op {op!r} (one of {', '.join(map(repr, OPS))})")


def read_threshold(
    reader: Reader,
    node: yaml.Node,
    op: Op,
    window: str | None,
    what: str,
    signals: Signals | None,
) -> Threshold:
    if _has_key(node, BASELINE_KEY):
        return _deviation(reader, node, window, what, signals)
    if op == "outside":
        if _names_signal(node):
            return _signal_band(reader, node, what, signals)
        return _band(reader, node, what)
    if isinstance(node, yaml.MappingNode) and not _names_signal(node):
        return _relative(reader, node, window, what, signals)
    if isinstance(node, yaml.SequenceNode):
        expected = "a number, {signal: NAME} or {relative_to: ...}"
        raise reader.wrong_type(node, f"{what} 'threshold'", expected)
    return _number(reader, node, f"{what} 'threshold'", signals)


def _number(reader: Reader, node: yaml.Node, what: str, signals: Signals | None) -> float:
    """A number, or `{signal: NAME}` naming a number among `signals`."""
    if _names_signal(node):
        value, name_node = _signal(reader, node, what, signals)
        if isinstance(value, tuple):
            raise reader.error(
                name_node, f"{what}: signal {name_node.value!r} is a band, not a number"
            )
        return value
    if not isinstance(node, yaml.ScalarNode):
        raise reader.wrong_type(node, what, "a number or {signal: NAME}")
    return reader.number(node, what)


def _names_signal(node: yaml.Node) -> bool:
    return _has_key(node, SIGNAL_KEY)


def _has_key(node: yaml.Node, name: str) -> bool:
    return isinstance(node, yaml.MappingNode) and any(
        isinstance(key, yaml.ScalarNode) and key.value == name for key, _ in node.value
    )


def _deviation(
    reader: Reader, node: yaml.Node, window: str | None, what: str, signals: Signals | None
) -> Deviation:
    """`{baseline: NAME, z: NUMBER | {signal: NAME}, count: METRIC}`."""
    where = f"{what} 'threshold'"
    entries = reader.mapping(node, where)
    reader.reject_unknown(entries, DEVIATION_KEYS, where)
    name_node = entries[BASELINE_KEY][1]
    name = reader.string(name_node, f"{where} {BASELINE_KEY!r}")
    if window is None or name not in BASELINE_SIGNALS:
        raise reader.error(
            name_node,
            f"{what}: unknown baseline {name!r} (needs a window rule and one of"
            f" {', '.join(BASELINE_SIGNALS)})",
        )
    if "z" not in entries:
        raise reader.error(node, f"{where}: missing field 'z' (standard errors, or a signal)")
    z = _number(reader, entries["z"][1], f"{where} 'z'", signals)
    if z < 0:
        raise reader.error(entries["z"][1], f"{where}: 'z' must be >= 0, got {z}")
    count = "requests"
    if "count" in entries:
        count = reader.string(entries["count"][1], f"{where} 'count'")
        if count not in WINDOW_METRICS:
            raise reader.error(entries["count"][1], f"{what}: unknown count metric {count!r}")
    return Deviation(signal=name, z=z, count=count)


def _signal(
    reader: Reader, node: yaml.Node, what: str, signals: Signals | None
) -> tuple[float | Band, yaml.Node]:
    """The value `{signal: NAME}` names, and the name's node (for errors)."""
    entries = reader.mapping(node, what)
    reader.reject_unknown(entries, (SIGNAL_KEY,), what)
    name_node = entries[SIGNAL_KEY][1]
    name = reader.string(name_node, f"{what} {SIGNAL_KEY!r}")
    if signals is None:
        raise reader.error(
            name_node,
            f"{what}: names signal {name!r} but no signal values were given: "
            "pass signals= to load_rules or parse_rules",
        )
    if name not in signals:
        known = ", ".join(sorted(signals))
        raise reader.error(name_node, f"{what}: unknown signal {name!r} (known: {known})")
    return signals[name], name_node


def _signal_band(reader: Reader, node: yaml.Node, what: str, signals: Signals | None) -> Band:
    value, name_node = _signal(reader, node, f"{what} 'threshold'", signals)
    if not isinstance(value, tuple):
        raise reader.error(
            name_node,
            f"{what}: signal {name_node.value!r} is a number; op 'outside' needs a band",
        )
    low, high = value
    if low > high:
        raise reader.error(name_node, f"{what}: bad threshold: low {low} is above high {high}")
    return low, high


def _band(reader: Reader, node: yaml.Node, what: str) -> Band:
    items = reader.sequence(node, f"{what} 'threshold' (op 'outside' needs [low, high])")
    if len(items) != 2:
        raise reader.error(node, f"{what}: bad threshold: op 'outside' needs [low, high]")
    low, high = (reader.number(item, f"{what} 'threshold'") for item in items)
    if low > high:
        raise reader.error(node, f"{what}: bad threshold: low {low} is above high {high}")
    return low, high


def _relative(
    reader: Reader, node: yaml.Node, window: str | None, what: str, signals: Signals | None
) -> Relative:
    entries = reader.mapping(node, f"{what} 'threshold'")
    reader.reject_unknown(entries, RELATIVE_KEYS, f"{what} 'threshold'")
    if "relative_to" not in entries:
        raise reader.error(node, f"{what} 'threshold': missing field 'relative_to'")
    base_node = entries["relative_to"][1]
    base = reader.string(base_node, f"{what} 'relative_to'")
    if window is None or base not in WINDOW_METRICS:
        raise reader.error(
            base_node,
            f"{what}: unknown metric {base!r} for 'relative_to' (needs a window rule and one of"
            f" {', '.join(WINDOW_METRICS)})",
        )
    factor = entries.get("factor")
    default = entries.get("default")
    return Relative(
        relative_to=base,
        factor=1.0 if factor is None else reader.number(factor[1], f"{what} 'factor'"),
        default=None
        if default is None
        else _number(reader, default[1], f"{what} 'default'", signals),
    )


def read_min_requests(reader: Reader, entry: Entry | None, window: str | None, what: str) -> int:
    if entry is None:
        return 0 if window is None else 1
    if window is None:
        raise reader.error(entry[0], f"{what}: 'min_requests' applies to window metrics only")
    count = reader.integer(entry[1], f"{what} 'min_requests'")
    if count < 0:
        raise reader.error(entry[1], f"{what}: 'min_requests' must be >= 0, got {count}")
    return count


def read_for(reader: Reader, entry: Entry | None, what: str) -> float:
    if entry is None:
        return 0.0
    text = reader.string(entry[1], f"{what} 'for' (a duration such as '5m')")
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise reader.error(entry[1], f"{what}: {exc}") from exc


def read_severity(reader: Reader, entry: Entry | None, what: str) -> Severity:
    if entry is None:
        return "warning"
    value = reader.string(entry[1], f"{what} 'severity'")
    for known in SEVERITIES:
        if value == known:
            return known
    raise reader.error(entry[1], f"{what}: bad severity {value!r} (one of {', '.join(SEVERITIES)})")


def read_labels(reader: Reader, entry: Entry | None, what: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    for key_node, value_node in _string_map(reader, entry, f"{what} 'labels'"):
        name = key_node.value
        if not NAME.fullmatch(name) or name.startswith("__") or name in RESERVED_LABELS:
            raise reader.error(key_node, f"{what}: bad label name {name!r}")
        labels[name] = value_node.value
    return labels


def read_annotations(reader: Reader, entry: Entry | None, what: str) -> dict[str, str]:
    annotations: dict[str, str] = {}
    for key_node, value_node in _string_map(reader, entry, f"{what} 'annotations'"):
        try:
            check_template(value_node.value)
        except ValueError as exc:
            raise reader.error(value_node, f"{what}: annotation {key_node.value!r}: {exc}") from exc
        annotations[key_node.value] = value_node.value
    return annotations


def _string_map(reader: Reader, entry: Entry | None, what: str) -> list[Entry]:
    """The (key, value) nodes of an optional mapping of strings to strings."""
    entries = reader.mapping(entry[1], what) if entry is not None else {}
    for name, (_, value) in entries.items():
        reader.string(value, f"{what} {name!r}")
    return list(entries.values())


def read_actions(reader: Reader, entry: Entry | None, what: str) -> tuple[str, ...]:
    if entry is None:
        return ()
    actions: list[str] = []
    for node in reader.sequence(entry[1], f"{what} 'actions'"):
        action = reader.string(node, f"{what} action")
        if action not in ACTIONS or action in actions:
            reason = "duplicate" if action in actions else "unknown"
            raise reader.error(
                node, f"{what}: {reason} action {action!r} (from {', '.join(ACTIONS)})"
            )
        actions.append(action)
    return tuple(actions)
