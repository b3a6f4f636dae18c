"""A local model directory's marker file (`sparseguard-model.json`): where the weights came
from, their sha256, and for a pruned (plan B) model its per-layer MLP sizes. One format, one
writer: the catalog's conversions and the pruner both write it through `write_marker`."""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

MARKER_NAME = "sparseguard-model.json"
PRUNED_KEY = "pruned"  # marker entry: {"intermediate_sizes": [...], "down_bias_layers": [...]}
WEIGHT_PATTERNS = ("*.safetensors", "*.bin")
_CHUNK_BYTES = 1 << 20


class ModelError(ValueError):
    """A model spec or directory is not usable; the message says what is accepted."""


def is_converted(model_dir: Path) -> bool:
    # The marker is written last and the directory moved into place in one step, so its
    # presence means the conversion finished.
    return (model_dir / MARKER_NAME).is_file()


def weights_sha256(model_dir: Path) -> str:
    """The weights' sha256: from the marker if present, else over *.safetensors/*.bin files."""
    marker = model_dir / MARKER_NAME
    if marker.is_file():
        return str(json.loads(marker.read_text())["weights_sha256"])
    return hash_weight_files(model_dir)


def write_marker(
    model_dir: Path, source: dict[str, str], pruned: dict[str, list[int]] | None = None
) -> None:
    """Write the marker last: it hashes the weight files already in `model_dir`."""
    marker: dict[str, Any] = {"source": source, "weights_sha256": hash_weight_files(model_dir)}
    if pruned is not None:
        marker[PRUNED_KEY] = pruned
    marker["created"] = datetime.now(UTC).isoformat(timespec="seconds")
    (model_dir / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")


def pruned_entry(model_dir: Path) -> dict[str, Any] | None:
    """The marker's `pruned` entry (per-layer MLP sizes) of a plan-B directory, else None."""
    marker = model_dir / MARKER_NAME
    if not marker.is_file():
        return None
    entry = json.loads(marker.read_text()).get(PRUNED_KEY)
    return entry if isinstance(entry, dict) else None


def hash_weight_files(model_dir: Path) -> str:
    files = sorted(path for pattern in WEIGHT_PATTERNS for path in model_dir.glob(pattern))
    if not files:
        raise ModelError(f"{model_dir} has no *.safetensors or *.bin weight files.")
    digest = hashlib.sha256()
    for path in files:
        with path.open("rb") as stream:
            while chunk := stream.read(_CHUNK_BYTES):
                digest.update(chunk)
    return digest.hexdigest()
