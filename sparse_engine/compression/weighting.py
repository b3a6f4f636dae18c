"""Weight-informed activation sparsity (WINA: rank a down-projection input by |x_i| times the
norm of the weight column it multiplies, not by |x_i| alone) as an exact re-parametrisation:
each layer's down-projection column norms c are folded into its up projection (up row i times
c_i, down column i over c_i). The model computes the same function (the MLP's gate
activation times up is linear in up), while a magnitude threshold on the down input, which
every sparsifier, calibration and kernel already applies, now ranks |x_i| * c_i."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import torch

from sparse_engine.model.arch import LayerParts, find_layers
from sparse_engine.model.loader import LoadedModel, wrap
from sparse_engine.model.model_dir import MARKER_NAME, WEIGHT_PATTERNS, weights_sha256, write_marker
from sparse_engine.model.surgery import mlp_linear

FOLD = "down-column-norms-into-up"
SUFFIX = "-wina"


def fold_down_norms(part: LayerParts) -> None:
    """Fold one layer's down-projection column norms into its up projection, in place."""
    up, down = mlp_linear(part, "up"), mlp_linear(part, "down")
    with torch.no_grad():
        norms = down.weight.norm(dim=0).clamp_min(torch.finfo(down.weight.dtype).tiny)
        up.weight.mul_(norms[:, None])
        if up.bias is not None:
            up.bias.mul_(norms)
        down.weight.div_(norms[None, :])


def folded_copy(lm: LoadedModel) -> LoadedModel:
    model = copy.deepcopy(lm.model)
    for part in find_layers(model):
        fold_down_norms(part)
    return wrap(model, lm.tokenizer, f"{lm.model_id}{SUFFIX}", "unsaved")


def save_folded(lm: LoadedModel, source_dir: Path | None, out_dir: Path) -> LoadedModel:
    """`lm` folded and written to `out_dir` (a model directory `load_model` reads), with the
    source directory's other files (licence terms, notices, chat template) beside it."""
    folded = folded_copy(lm)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MARKER_NAME).unlink(missing_ok=True)  # a stale marker would carry a stale hash
    folded.model.save_pretrained(out_dir)
    lm.tokenizer.save_pretrained(out_dir)
    if source_dir is not None:
        weights = {p for pattern in WEIGHT_PATTERNS for p in source_dir.glob(pattern)}
        for path in source_dir.iterdir():
            kept = path.is_file() and path not in weights and path.name != MARKER_NAME
            if kept and not (out_dir / path.name).exists():
                shutil.copy(path, out_dir / path.name)
    source = {"folded_from": lm.model_id, "weights_sha256": lm.weights_sha256, "fold": FOLD}
    write_marker(out_dir, source)
    return wrap(folded.model, lm.tokenizer, out_dir.name, weights_sha256(out_dir))
