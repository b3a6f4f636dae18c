"""Thresholds from statistics, and TEAL-style greedy per-layer sparsity allocation: raise
sparsity first where a unit's output error grows least."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sparse_engine.calibration.stats import ActivationStats, quantile_threshold
from sparse_engine.model.arch import LayerParts, Unit, input_width

GRID = tuple(i / 40 for i in range(39))  # 0.0 .. 0.95 in steps of 0.025


def thresholds_for(
    stats: ActivationStats, targets: dict[Unit, float]
) -> dict[str, tuple[float, ...]]:
    """Per-role, per-layer magnitude thresholds reaching each unit's target sparsity."""
    roles = sorted({role for role, _ in targets})
    num_layers = 1 + max(layer for _, layer in targets)
    return {
        role: tuple(
            quantile_threshold(stats.histogram(role, layer), targets[(role, layer)])
            for layer in range(num_layers)
        )
        for role in roles
    }


def uniform_targets(
    stats: ActivationStats, roles: tuple[str, ...], target: float
) -> dict[Unit, float]:
    return {unit: target for unit in stats.units if unit[0] in roles}


def error_curves(
    stats: ActivationStats, layers: list[LayerParts], roles: tuple[str, ...]
) -> dict[Unit, list[float]]:
    """Output error of each unit's projection on its reservoir rows at every sparsity of GRID:
    the squared error of the projection's output per reservoir row (token), in the units of
    the residual stream it is added into, so errors of different layers add up directly."""
    curves = {}
    with torch.inference_mode():
        for part in layers:
            for role in roles:
                module = part.get(role)
                curves[(role, part.index)] = _curve(stats, (role, part.index), module)
    return curves


@dataclass(slots=True)
class AllocationPath:
    """The greedy path: after each step, the size-weighted mean sparsity and each unit's
    GRID index."""

    units: list[Unit]
    weights: list[int]
    steps: list[tuple[float, tuple[int, ...]]]

    def at(self, mean_target: float) -> dict[Unit, float]:
        """The first allocation on the path whose mean sparsity reaches `mean_target`."""
        for mean, indices in self.steps:
            if mean >= mean_target - 1e-9:
                return {u: GRID[i] for u, i in zip(self.units, indices, strict=True)}
        _, indices = self.steps[-1]
        return {u: GRID[i] for u, i in zip(self.units, indices, strict=True)}


def greedy_path(curves: dict[Unit, list[float]], widths: dict[Unit, int]) -> AllocationPath:
    units = sorted(curves)
    weights = [widths[u] for u in units]
    total = sum(weights)
    index = [0] * len(units)
    steps = [(0.0, tuple(index))]
    last = len(GRID) - 1
    while True:
        candidates = [
            (curves[u][i + 1] - curves[u][i], n)
            for n, (u, i) in enumerate(zip(units, index, strict=True))
            if i < last
        ]
        if not candidates:
            break
        _, best = min(candidates)
        index[best] += 1
        mean = sum(GRID[i] * w for i, w in zip(index, weights, strict=True)) / total
        steps.append((mean, tuple(index)))
    return AllocationPath(units, weights, steps)


def unit_widths(layers: list[LayerParts], roles: tuple[str, ...]) -> dict[Unit, int]:
    return {(role, p.index): input_width(p.get(role)) for p in layers for role in roles}


def _curve(stats: ActivationStats, unit: Unit, module: nn.Module) -> list[float]:
    rows = stats.units[unit].reservoir
    full = module(rows)
    norm = float(rows.shape[0])
    curve = []
    for target in GRID:
        threshold = quantile_threshold(stats.histogram(*unit), target)
        sparse = rows * (rows.abs() > threshold)
        curve.append(float((full - module(sparse)).pow(2).sum()) / norm)
    return curve
