"""Calibration: a pure pipeline from data to a versioned artefact: activation statistics
(`stats`), per-layer allocation of sparsity (`allocation`, `sensitivity`), the level search
(`pipeline`) and the store of calibrations (`store`). May import `runtime` and everything
below it."""

from sparse_engine.calibration.pipeline import (
    CalibrationConfig,
    CalibrationData,
    calibrate,
    prepare_data,
)
from sparse_engine.calibration.store import Calibration, CalibrationNotFoundError, CalibrationStore

__all__ = [
    "Calibration",
    "CalibrationConfig",
    "CalibrationData",
    "CalibrationNotFoundError",
    "CalibrationStore",
    "calibrate",
    "prepare_data",
]
