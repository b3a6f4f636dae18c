"""Measured end-to-end sensitivity of each unit: the KL(dense || sparse) of the model's output
when that unit alone is sparsified. Local output-error proxies misrank layers (early layers
and layers with massive activations look cheap and are not), so the greedy allocation scales
each unit's local error curve by this measurement."""

from __future__ import annotations

import torch
from torch import nn

from sparse_engine.calibration.allocation import GRID
from sparse_engine.calibration.stats import ActivationStats, quantile_threshold
from sparse_engine.model.arch import LayerParts, Unit
from sparse_engine.sparsity import signals
from sparse_engine.sparsity.hooks import sparsified
from sparse_engine.sparsity.plan import Level, SparsityPlan

ANCHOR = 0.5


def unit_sensitivity(
    model: nn.Module,
    layers: list[LayerParts],
    stats: ActivationStats,
    batch: torch.Tensor,
    units: list[Unit],
) -> dict[Unit, float]:
    """Mean token KL when only `unit` is sparsified to ANCHOR sparsity, for each unit."""
    with torch.inference_mode():
        dense = model(input_ids=batch).logits.flatten(0, 1)
        result = {}
        for role, layer in units:
            thresholds = [0.0] * len(layers)
            thresholds[layer] = quantile_threshold(stats.histogram(role, layer), ANCHOR)
            plan = SparsityPlan(Level.BALANCED, {role: tuple(thresholds)})
            with sparsified(layers, plan):
                sparse = model(input_ids=batch).logits.flatten(0, 1)
            result[(role, layer)] = float(signals.token_kl(dense, sparse).mean())
    return result


def scale_curves(
    curves: dict[Unit, list[float]], sensitivity: dict[Unit, float]
) -> dict[Unit, list[float]]:
    """Each unit's local curve rescaled so that its value at ANCHOR is the measured KL."""
    anchor = GRID.index(ANCHOR)
    scaled = {}
    for unit, curve in curves.items():
        factor = sensitivity[unit] / curve[anchor] if curve[anchor] > 0 else 0.0
        scaled[unit] = [value * factor for value in curve]
    return scaled
