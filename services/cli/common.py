"""Helpers shared by the CLI commands: output, progress, loading an engine."""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from services.config import Settings
from services.shared.engine import configure_fast_path
from sparse_engine.calibration.store import CalibrationStore
from sparse_engine.model.catalog import resolve_model
from sparse_engine.model.loader import LoadedModel, load_model
from sparse_engine.runtime.engine import Engine


def emit(text: str) -> None:
    """Command output (results, tables) goes to stdout; diagnostics go to the log."""
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    sys.stdout.flush()


def emit_json(value: Any) -> None:
    emit(json.dumps(value, indent=2, sort_keys=True))


def load(settings: Settings, model: str | None) -> LoadedModel:
    if settings.engine.threads:
        torch.set_num_threads(settings.engine.threads)
    return load_model(resolve_model(model or settings.engine.model, settings.cache_home))


def store(settings: Settings) -> CalibrationStore:
    return CalibrationStore(settings.calibrations_dir)


def engine(settings: Settings, model: str | None, fast: bool = True) -> Engine:
    """The calibrated engine; `fast=False` keeps it on the Hugging Face reference path."""
    built = Engine.from_store(load(settings, model), store(settings))
    return configure_fast_path(built, settings) if fast else built
