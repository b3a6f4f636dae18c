"""SparseGuard's sparse inference library: loads Hugging Face decoders, sparsifies them with
removable hooks, calibrates, generates and measures every request. Returns plain dataclasses
and never imports the services' stack (Kafka, Prometheus, Celery, FastAPI, SQL).

Subpackages, lowest first (each imports only those before it): `jsonstore` and `data`,
`model`, `sparsity`, `evaluation`, `runtime`, `calibration`, `trust`, `compression`, `bench`.
"""

from sparse_engine.calibration import Calibration, CalibrationConfig, CalibrationStore, calibrate
from sparse_engine.model import LoadedModel, load_model, resolve_model
from sparse_engine.runtime import Engine, Generation, GenerationRequest, PrefixCache
from sparse_engine.sparsity import Level, SparsityPlan

__all__ = [
    "Calibration",
    "CalibrationConfig",
    "CalibrationStore",
    "Engine",
    "Generation",
    "GenerationRequest",
    "Level",
    "LoadedModel",
    "PrefixCache",
    "SparsityPlan",
    "calibrate",
    "load_model",
    "resolve_model",
]
