"""Helpers shared by the CLI commands: output and the calibration store."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from services.config import Settings
from sparse_engine.calibration.store import CalibrationStore


def emit(text: str) -> None:
    """Command output (results, tables) goes to stdout; diagnostics go to the log."""
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    sys.stdout.flush()


def emit_json(value: Any) -> None:
    emit(json.dumps(value, indent=2, sort_keys=True))


def store(settings: Settings) -> CalibrationStore:
    return CalibrationStore(settings.calibrations_dir)


def eval_commands(commands: Any) -> Any:
    """The `sparseguard eval` group's sub-commands (`eval trust`, `eval alerts`), made by the
    first command module that asks."""
    if "eval" not in commands.choices:
        group = commands.add_parser("eval", help="evaluations of the service's own judgements")
        group.add_subparsers(dest="target", required=True)
    parser = commands.choices["eval"]
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
