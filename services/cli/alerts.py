"""`sparseguard alerts`: validate a rules file, export it as Prometheus alerting rules."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from alerts.prometheus import export_prometheus, unexported
from alerts.rules import DEFAULT_RULES, Rule, load_rules
from services.aggregator.metrics import ALERT_SERIES
from services.config import Settings


def register(commands: Any) -> None:
    a = commands.add_parser("alerts", help="alert rules: check, export to Prometheus")
    verbs = a.add_subparsers(dest="alerts_command", required=True, metavar="VERB")
    export = verbs.add_parser(
        "export-prometheus", help="write the rules as Prometheus alerting rules (YAML)"
    )
    _rules_option(export)
    export.add_argument("--out", type=Path, help="output file (default: stdout)")
    export.set_defaults(handler=run_export)
    check = verbs.add_parser("check", help="load and validate the rules, print their names")
    _rules_option(check)
    check.set_defaults(handler=run_check)


def _rules_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rules",
        type=Path,
        help="rules file (default: settings alerts.rules_file, else the packaged defaults)",
    )


def _rules(args: argparse.Namespace, settings: Settings) -> list[Rule]:
    path: Path = args.rules or settings.alerts.rules_file or DEFAULT_RULES
    return load_rules(path, settings.signals.as_thresholds())


def run_export(args: argparse.Namespace, settings: Settings) -> int:
    text = export_prometheus(_rules(args, settings), ALERT_SERIES)
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text, encoding="utf-8")
    return 0


def run_check(args: argparse.Namespace, settings: Settings) -> int:
    rules = _rules(args, settings)
    skipped = {rule.name for rule in unexported(rules, ALERT_SERIES)}
    for rule in rules:
        note = "  (evaluator only: no Prometheus series)" if rule.name in skipped else ""
        sys.stdout.write(f"{rule.name}{note}\n")
    return 0
