"""Sparsity: what a sparse forward pass does (`plan`), the removable hooks that do it (`hooks`),
runtime channel masks (`masking`, plan A), learned gates (`gates`), and the per-request
signals (`signals`, pure tensor functions; `recorder`, their accumulation inside the hooks).
May import `model` and `data`."""

from sparse_engine.sparsity.gates import Gates, load_gates
from sparse_engine.sparsity.hooks import sparsified
from sparse_engine.sparsity.masking import ChannelMask, masked
from sparse_engine.sparsity.plan import SPARSE_LEVELS, CalibrationNotFoundError, Level, SparsityPlan
from sparse_engine.sparsity.recorder import LayerCounts, SignalRecorder, SignalSummary

__all__ = [
    "SPARSE_LEVELS",
    "CalibrationNotFoundError",
    "ChannelMask",
    "Gates",
    "LayerCounts",
    "Level",
    "SignalRecorder",
    "SignalSummary",
    "SparsityPlan",
    "load_gates",
    "masked",
    "sparsified",
]
