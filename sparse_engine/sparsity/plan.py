"""What a sparse forward pass does: per-layer thresholds or Top-K, bound to a level."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sparse_engine.sparsity.gates import Gates


class CalibrationNotFoundError(LookupError):
    """No calibration matches the request (a level, a version, a model's weights)."""


class Level(StrEnum):
    DENSE = "dense"
    CONSERVATIVE = "conservative"
    BALANCED = "balanced"
    AGGRESSIVE = "aggressive"

    @classmethod
    def parse(cls, value: str) -> Level:
        try:
            return cls(value.strip().lower())
        except ValueError:
            names = ", ".join(level.value for level in cls)
            raise ValueError(f"unknown level '{value}'; choose one of: {names}") from None


SPARSE_LEVELS = (Level.CONSERVATIVE, Level.BALANCED, Level.AGGRESSIVE)
# Quality budgets: the largest held-out perplexity increase, in percent, a level may cost.
DEFAULT_BUDGETS_PCT: dict[Level, float] = {
    Level.CONSERVATIVE: 0.5,
    Level.BALANCED: 2.0,
    Level.AGGRESSIVE: 8.0,
}


@dataclass(frozen=True, slots=True)
class SparsityPlan:
    """Per-layer sparsifier settings. `thresholds` maps a projection role ("down", "q", ...)
    to one magnitude threshold per layer; `topk` keeps K dims of each block's attention and
    MLP output per layer. `silence_thresholds` (per layer, on the MLP down-projection input)
    define the per-request silence rate and do not change the computation. `gates` (learned,
    `sparsity.gates`) keep the MLP channels whose gate, its logit shifted by `gate_offset`,
    is open."""

    level: Level = Level.DENSE
    thresholds: dict[str, tuple[float, ...]] = field(default_factory=dict)
    topk: tuple[int, ...] | None = None
    silence_thresholds: tuple[float, ...] | None = None
    calibration_version: str | None = None
    gates: Gates | None = None
    gate_offset: float = 0.0

    @property
    def is_dense(self) -> bool:
        return not self.thresholds and self.topk is None and self.gates is None

    def as_dense(self) -> SparsityPlan:
        """The same silence reference with no sparsification."""
        return SparsityPlan(silence_thresholds=self.silence_thresholds)
