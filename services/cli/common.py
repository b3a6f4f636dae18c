"""Helpers shared by the CLI commands: output, progress, loading an engine."""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from services.config import Settings
from services.engine_setup import configure_fast_path
from sparse_engine.artefacts import CalibrationStore
from sparse_engine.calibrate import shuffled
from sparse_engine.engine import Engine
from sparse_engine.loader import LoadedModel, load_model
from sparse_engine.models import resolve_model


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


def middle_tokens(eng: Engine, texts: list[str], count: int) -> torch.Tensor:
    """Tokens from the middle of the corpus in calibration's document order: calibration
    samples come from its front and held-out text from its back, so the middle is unseen."""
    ids: list[int] = []
    texts = shuffled(texts)
    for text in texts[len(texts) // 2 :] or texts:
        ids.extend(eng.lm.tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(ids) >= count:
            break
    return torch.tensor(ids[:count])
