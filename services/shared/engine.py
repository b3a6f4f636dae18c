"""The engine as the settings configure it: the fast decode path on top of the calibrated
plans, with the compiled kernels when they build."""

from __future__ import annotations

from services.config import Settings
from sparse_engine.runtime import kernels
from sparse_engine.runtime.engine import Engine


def configure_fast_path(engine: Engine, settings: Settings) -> Engine:
    if settings.engine.fast_path != "off":
        native = kernels.load()
        engine.enable_fast_path(
            settings.engine.fast_path, native, settings.engine.fast_path_max_len
        )
    return engine
