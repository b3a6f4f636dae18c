"""Activation statistics for calibration: log-magnitude histograms per (role, layer) and a
bounded reservoir of input rows per unit, gathered with hooks in one pass over the data."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from sparse_engine.model.arch import LayerParts, Unit, run_hooked

LOG10_MIN, LOG10_MAX, NUM_BINS = -8.0, 4.0, 4800


@dataclass(slots=True)
class UnitStats:
    """Statistics of the input of one projection in one layer."""

    histogram: torch.Tensor  # counts over log10|x| bins, float64
    reservoir: torch.Tensor  # up to `max_rows` sampled input rows
    rows_seen: int = 0


@dataclass(slots=True)
class ActivationStats:
    units: dict[Unit, UnitStats] = field(default_factory=dict)
    num_tokens: int = 0

    def histogram(self, role: str, layer: int) -> torch.Tensor:
        return self.units[(role, layer)].histogram


def collect_stats(
    model: nn.Module,
    layers: list[LayerParts],
    batches: Iterable[torch.Tensor],
    roles: tuple[str, ...],
    max_rows: int = 256,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> ActivationStats:
    """Run `batches` (token id tensors, shape (1, T), each a sequence from position 0) through
    the model and gather input statistics of each role's projection in each layer, leaving out
    position 0, which the sparsifier never touches (`sparsity.hooks`)."""
    stats = ActivationStats()
    generator = torch.Generator().manual_seed(seed)
    handles = []
    for part in layers:
        for role in roles:
            hook = _stats_hook(stats, (role, part.index), max_rows, generator)
            handles.append(part.get(role).register_forward_pre_hook(hook))

    def count(ids: torch.Tensor) -> None:
        stats.num_tokens += ids.numel()
        if progress is not None:
            progress(ids.numel())

    run_hooked(model, handles, batches, count)
    return stats


def log_bins(x: torch.Tensor) -> torch.Tensor:
    """Histogram of log10|x| on the fixed grid; zeros and tiny values land in the first bin."""
    logs = torch.log10(x.abs().float().clamp_min(10**LOG10_MIN)).clamp(LOG10_MIN, LOG10_MAX)
    return torch.histc(logs, bins=NUM_BINS, min=LOG10_MIN, max=LOG10_MAX).double()


def quantile_threshold(histogram: torch.Tensor, target: float) -> float:
    """Magnitude below which a `target` share of the histogram's values lie (log-interpolated)."""
    if not 0.0 <= target < 1.0:
        raise ValueError(f"target sparsity must be in [0, 1), got {target}")
    if target == 0.0:
        return 0.0
    cdf = histogram.cumsum(0) / histogram.sum()
    index = int(torch.searchsorted(cdf, torch.tensor(target, dtype=cdf.dtype)))
    index = min(index, NUM_BINS - 1)
    below = float(cdf[index - 1]) if index > 0 else 0.0
    inside = float(cdf[index]) - below
    fraction = (target - below) / inside if inside > 0 else 1.0
    width = (LOG10_MAX - LOG10_MIN) / NUM_BINS
    return float(10 ** (LOG10_MIN + (index + fraction) * width))


def _stats_hook(
    stats: ActivationStats, key: tuple[str, int], max_rows: int, generator: torch.Generator
) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0].detach()
        if x.dim() == 3 and x.shape[1] > 1:
            x = x[:, 1:]  # position 0 stays dense
        rows = x.reshape(-1, x.shape[-1]).float()
        unit = stats.units.get(key)
        if unit is None:
            unit = stats.units[key] = UnitStats(
                torch.zeros(NUM_BINS, dtype=torch.float64), rows.new_empty(0, rows.shape[-1])
            )
        unit.histogram += log_bins(rows)
        _reservoir_add(unit, rows, max_rows, generator)

    return hook


def _reservoir_add(
    unit: UnitStats, rows: torch.Tensor, max_rows: int, generator: torch.Generator
) -> None:
    free = max_rows - unit.reservoir.shape[0]
    if free > 0:
        unit.reservoir = torch.cat([unit.reservoir, rows[:free]])
        unit.rows_seen += min(free, rows.shape[0])
        rows = rows[free:]
    if rows.shape[0] == 0:
        return
    # Reservoir sampling (Algorithm R), vectorised over the new rows.
    seen = unit.rows_seen + torch.arange(1, rows.shape[0] + 1, dtype=torch.float64)
    slots = (torch.rand(rows.shape[0], generator=generator, dtype=torch.float64) * seen).long()
    chosen = slots < max_rows
    unit.reservoir[slots[chosen]] = rows[chosen]
    unit.rows_seen += rows.shape[0]
