"""Models: where a decoder's parts live (`arch`, the role table), loading one (`loader`), the
models known by name and their pins (`known`), fetching and GGUF conversion (`catalog`), the
plain chat template and start-of-text tokens (`chat`), a model directory's marker file
(`model_dir`), and resizing MLPs (`surgery`, shared by the loader and plan-B pruning).
May import `data` only."""

from sparse_engine.model.arch import (
    LayerParts,
    Unit,
    UnsupportedModelError,
    find_layers,
    input_width,
)
from sparse_engine.model.catalog import (
    DEFAULT_MODEL,
    ModelStatus,
    fetch_model,
    gguf_file,
    known_model,
    model_statuses,
    resolve_model,
)
from sparse_engine.model.loader import LoadedModel, load_model, wrap
from sparse_engine.model.model_dir import MARKER_NAME, ModelError, weights_sha256

__all__ = [
    "DEFAULT_MODEL",
    "MARKER_NAME",
    "LayerParts",
    "LoadedModel",
    "ModelError",
    "ModelStatus",
    "Unit",
    "UnsupportedModelError",
    "fetch_model",
    "find_layers",
    "gguf_file",
    "input_width",
    "known_model",
    "load_model",
    "model_statuses",
    "resolve_model",
    "weights_sha256",
    "wrap",
]
