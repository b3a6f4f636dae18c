"""The engine as the settings configure it, built one way for every process that runs the
model (gateway, CLI, golden check, recalibration), so each measures the decode path that is
served: the calibrated plans, the fast decode path in the configured weight type, and the
compiled kernels when they build."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from services.config import Settings
from sparse_engine.calibration.store import CalibrationStore
from sparse_engine.model.catalog import resolve_model
from sparse_engine.model.loader import LoadedModel, load_model
from sparse_engine.runtime import kernels
from sparse_engine.runtime.engine import Engine
from sparse_engine.runtime.prefix_cache import PrefixCache


def load_served_model(settings: Settings, model: str | None = None) -> LoadedModel:
    """`model` (a known name, HF directory or GGUF file; default: the served model), with the
    configured torch threads."""
    if settings.engine.threads:
        torch.set_num_threads(settings.engine.threads)
    return load_model(resolve_model(model or settings.engine.model, settings.cache_home))


def build_engine(
    settings: Settings,
    model: str | LoadedModel | None = None,
    *,
    prefix_cache: bool = False,  # on where settings allow it (prefix_cache_entries > 0)
    fast: bool = True,
) -> Engine:
    """The calibrated engine for `model` (default: the served model). `fast=False` keeps it on
    the Hugging Face reference path (the reference rows of the benchmarks)."""
    lm = model if isinstance(model, LoadedModel) else load_served_model(settings, model)
    cache: PrefixCache[DynamicCache] | None = (
        PrefixCache() if prefix_cache and settings.engine.prefix_cache_entries else None
    )
    plans = CalibrationStore(settings.calibrations_dir).latest_plans(lm.weights_sha256)
    engine = Engine(lm, plans, cache)
    if fast and settings.engine.fast_path != "off":
        native = kernels.load()
        engine.enable_fast_path(
            settings.engine.fast_path, native, settings.engine.fast_path_max_len
        )
    return engine
