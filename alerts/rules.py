"""Alert rules from YAML: `load_rules(path, signals)`, `parse_rules(text, source, signals)` and the
packaged `DEFAULT_RULES`. Every mistake raises `RuleError` naming the file, the line and the reason.

A file is a mapping with one key, `rules`, a list of rules:

    rules:
      - name: SparsityBelowTarget        # required, a Prometheus alert name
        metric: sparsity_mean            # required, see alerts.definitions
        window: 5m                       # window metrics only: 5m | 1h | 24h
        op: "<"                          # required: < | > | outside
        threshold: {relative_to: sparsity_target, default: {signal: sparsity_target_default}}
        min_requests: 20                 # window metrics only, default 1
        for: 5m                          # default 0s: fire at once
        severity: warning                # info | warning | critical, default warning
        labels: {team: inference}
        annotations: {summary: "...", description: "... {{ $labels.model }} ..."}
        actions: [webhook, recalibrate]  # webhook | recalibrate | flag_finetune | fallback

`threshold` is a number, `[low, high]` for `outside`, or a mapping relative to another metric
of the same sample. A number or a band may instead name a signal value, `{signal: gate_band}`:
`signals` maps those names to their values (the services pass their signal settings, so a rule
and the gateway never hold two copies of one threshold). Rules that name a signal need it.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from alerts import rule_fields as fields
from alerts.definitions import Relative, Rule, RuleError, Signals
from alerts.yaml_nodes import Reader

__all__ = [
    "DEFAULT_RULES",
    "Relative",
    "Rule",
    "RuleError",
    "Signals",
    "load_rules",
    "parse_rules",
]

DEFAULT_RULES = Path(__file__).with_name("default_rules.yaml")
RULE_KEYS = (
    "name",
    "metric",
    "window",
    "op",
    "threshold",
    "min_requests",
    "for",
    "severity",
    "labels",
    "annotations",
    "actions",
)
REQUIRED = ("metric", "op", "threshold")


def load_rules(path: Path | str, signals: Signals | None = None) -> list[Rule]:
    file = Path(path)
    return parse_rules(file.read_text(encoding="utf-8"), str(file), signals)


def parse_rules(text: str, source: str = "<rules>", signals: Signals | None = None) -> list[Rule]:
    reader = Reader(source)
    root = _compose(text, source)
    top = reader.mapping(root, "the rules file")
    reader.reject_unknown(top, ("rules",), "the rules file")
    if "rules" not in top:
        raise reader.error(root, "the rules file: missing field 'rules'")
    rules: list[Rule] = []
    seen: dict[str, int] = {}
    for node in reader.sequence(top["rules"][1], "'rules'"):
        rule = _rule(reader, node, signals)
        if rule.name in seen:
            raise reader.error(
                node, f"duplicate rule name {rule.name!r} (first defined on line {seen[rule.name]})"
            )
        seen[rule.name] = node.start_mark.line + 1
        rules.append(rule)
    return rules


def _compose(text: str, source: str) -> yaml.Node:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 1
        reason = f"invalid YAML: {exc.problem}"
        if exc.context and exc.context_mark is not None:
            reason += f" ({exc.context} on line {exc.context_mark.line + 1})"
        raise RuleError(f"{source}:{line}: {reason}") from exc
    except yaml.YAMLError as exc:
        raise RuleError(f"{source}:1: invalid YAML: {exc}") from exc
    if root is None:
        raise RuleError(f"{source}:1: empty rules file: expected a mapping with 'rules'")
    return root


def _rule(reader: Reader, node: yaml.Node, signals: Signals | None) -> Rule:
    entries = reader.mapping(node, "rule")
    if "name" not in entries:
        raise reader.error(node, "rule: missing field 'name'")
    name = fields.read_name(reader, entries["name"][1])
    what = f"rule {name!r}"
    reader.reject_unknown(entries, RULE_KEYS, what)
    for key in REQUIRED:
        if key not in entries:
            raise reader.error(node, f"{what}: missing field {key!r}")
    metric = fields.read_metric(reader, entries["metric"][1], what)
    window = fields.read_window(reader, entries.get("window"), node, metric, what)
    op = fields.read_op(reader, entries["op"][1], what)
    return Rule(
        name=name,
        metric=metric,
        window=window,
        op=op,
        threshold=fields.read_threshold(reader, entries["threshold"][1], op, window, what, signals),
        min_requests=fields.read_min_requests(reader, entries.get("min_requests"), window, what),
        for_s=fields.read_for(reader, entries.get("for"), what),
        severity=fields.read_severity(reader, entries.get("severity"), what),
        labels=fields.read_labels(reader, entries.get("labels"), what),
        annotations=fields.read_annotations(reader, entries.get("annotations"), what),
        actions=fields.read_actions(reader, entries.get("actions"), what),
    )
