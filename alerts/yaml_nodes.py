"""Typed reads of composed YAML nodes that keep each value's line, so an invalid rules file is
reported as `file:line: reason`."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import yaml
from yaml.constructor import SafeConstructor

from alerts.definitions import RuleError

TAG = "tag:yaml.org,2002:"
Entry = tuple[yaml.Node, yaml.Node]  # (key node, value node)


def describe(node: yaml.Node) -> str:
    """What a node holds, for 'expected X, got Y' messages."""
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    kinds = {"int": "an integer", "float": "a number", "bool": "a boolean", "null": "null"}
    kind = kinds.get(str(node.tag).removeprefix(TAG))
    return kind or f"the string {node.value!r}"


@dataclass(frozen=True, slots=True)
class Reader:
    source: str

    def error(self, node: yaml.Node, reason: str) -> RuleError:
        return RuleError(f"{self.source}:{node.start_mark.line + 1}: {reason}")

    def wrong_type(self, node: yaml.Node, what: str, expected: str) -> RuleError:
        return self.error(node, f"wrong type for {what}: expected {expected}, got {describe(node)}")

    def mapping(self, node: yaml.Node, what: str) -> dict[str, Entry]:
        """The entries of a mapping node by key; keys must be unique strings."""
        if not isinstance(node, yaml.MappingNode):
            raise self.wrong_type(node, what, "a mapping")
        entries: dict[str, Entry] = {}
        for key, value in node.value:
            if not (isinstance(key, yaml.ScalarNode) and key.tag == TAG + "str"):
                raise self.wrong_type(key, f"a key of {what}", "a string")
            if key.value in entries:
                raise self.error(key, f"{what}: duplicate key {key.value!r}")
            entries[key.value] = (key, value)
        return entries

    def reject_unknown(self, entries: dict[str, Entry], allowed: Iterable[str], what: str) -> None:
        known = tuple(allowed)
        for name, (key, _) in entries.items():
            if name not in known:
                raise self.error(
                    key, f"{what}: unknown key {name!r} (expected one of: {', '.join(known)})"
                )

    def sequence(self, node: yaml.Node, what: str) -> list[yaml.Node]:
        if not isinstance(node, yaml.SequenceNode):
            raise self.wrong_type(node, what, "a list")
        return list(node.value)

    def string(self, node: yaml.Node, what: str) -> str:
        if not (isinstance(node, yaml.ScalarNode) and node.tag == TAG + "str"):
            raise self.wrong_type(node, what, "a string")
        return str(node.value)

    def integer(self, node: yaml.Node, what: str) -> int:
        if not (isinstance(node, yaml.ScalarNode) and node.tag == TAG + "int"):
            raise self.wrong_type(node, what, "an integer")
        return int(SafeConstructor().construct_object(node))

    def number(self, node: yaml.Node, what: str) -> float:
        if not (isinstance(node, yaml.ScalarNode) and node.tag in (TAG + "int", TAG + "float")):
            raise self.wrong_type(node, what, "a number")
        value = float(SafeConstructor().construct_object(node))
        if not math.isfinite(value):
            raise self.error(node, f"wrong type for {what}: expected a finite number")
        return value

    def is_null(self, node: yaml.Node) -> bool:
        return isinstance(node, yaml.ScalarNode) and node.tag == TAG + "null"
