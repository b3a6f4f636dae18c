"""Helpers shared by the CLI commands: output and the calibration store."""

from __future__ import annotations

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
