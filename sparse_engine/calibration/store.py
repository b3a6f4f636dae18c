"""Calibrations as versioned artefacts in a `JsonStore`, loaded by version."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sparse_engine.jsonstore import JsonStore, stamped_version
from sparse_engine.sparsity.gates import load_gates
from sparse_engine.sparsity.plan import SPARSE_LEVELS, Level, SparsityPlan
from sparse_engine.sparsity.plan import CalibrationNotFoundError as CalibrationNotFoundError


@dataclass(slots=True)
class Calibration:
    model_id: str
    weights_sha256: str
    level: str
    sparsifier: str
    thresholds: dict[str, list[float]]
    topk: list[int] | None
    silence_thresholds: list[float]
    target_sparsity: float
    realised_sparsity: float
    perplexity_dense: float
    perplexity_sparse: float
    budget_pct: float
    data: dict[str, Any]
    duration_s: float
    allocation: str = "uniform"
    # The healthy baselines of this level and of the dense level, measured on the engine as
    # served with this plan (`calibration.baseline.LevelBaseline.to_dict`); None before the
    # baseline pass, and in artefacts made before baselines existed.
    baseline: dict[str, Any] | None = None
    dense_baseline: dict[str, Any] | None = None
    # A learned-gate plan (sparsifier "gates"): the artefact's path, pinned sha256, version
    # and the logit offset this level runs at.
    gates: dict[str, Any] | None = None
    created_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    version: str = ""

    @property
    def perplexity_change_pct(self) -> float:
        return 100.0 * (self.perplexity_sparse / self.perplexity_dense - 1.0)

    def plan(self) -> SparsityPlan:
        gates = self.gates or {}
        return SparsityPlan(
            level=Level.parse(self.level),
            thresholds={role: tuple(v) for role, v in self.thresholds.items()},
            topk=tuple(self.topk) if self.topk is not None else None,
            silence_thresholds=tuple(self.silence_thresholds),
            calibration_version=self.version,
            gates=load_gates(gates["path"], gates["sha256"]) if gates else None,
            gate_offset=float(gates.get("offset", 0.0)),
        )

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "perplexity_change_pct": self.perplexity_change_pct}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Calibration:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def new_version(cal: Calibration) -> str:
    """`<model>-<level>-<UTC time>-<content hash>`: sortable by time, unique by content."""
    slug = re.sub(r"[^a-z0-9]+", "-", cal.model_id.lower()).strip("-")
    content = [cal.thresholds, cal.topk, cal.weights_sha256, cal.gates]
    return stamped_version(f"{slug}-{cal.level}", cal.created_at, content)


class CalibrationStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._files = JsonStore(root)

    def save(self, cal: Calibration) -> Calibration:
        """Write `cal` under a new version; a crash never leaves a partial file."""
        if not cal.version:
            cal.version = new_version(cal)
        self._files.save(cal.version, cal.to_dict())
        return cal

    def load(self, version: str) -> Calibration:
        data = self._files.load(version)
        if data is None:
            raise CalibrationNotFoundError(
                f"no calibration '{version}' in {self.root}; see `sparseguard calibrations list`"
            )
        return Calibration.from_dict(data)

    def list(self, weights_sha256: str | None = None) -> list[Calibration]:
        found = [Calibration.from_dict(data) for data in self._files.all()]
        if weights_sha256 is not None:
            found = [c for c in found if c.weights_sha256 == weights_sha256]
        return sorted(found, key=lambda c: (c.created_at, c.version))

    def latest(self, weights_sha256: str, level: Level, corpus: str | None = None) -> Calibration:
        matching = [c for c in self.list(weights_sha256) if c.level == level.value]
        if corpus is not None:
            matching = [c for c in matching if c.data.get("corpus") == corpus]
        if not matching:
            raise CalibrationNotFoundError(
                f"no '{level.value}' calibration for this model; "
                f"run `sparseguard calibrate --level {level.value}`"
                + (f" --data {corpus}" if corpus else "")
            )
        return matching[-1]

    def latest_plans(self, weights_sha256: str) -> dict[Level, SparsityPlan]:
        """Each calibrated sparse level's latest plan for these weights, and the dense plan
        carrying their silence reference (empty when nothing is calibrated)."""
        plans = {}
        for level in SPARSE_LEVELS:
            try:
                plans[level] = self.latest(weights_sha256, level).plan()
            except CalibrationNotFoundError:
                continue
        if plans:
            plans[Level.DENSE] = next(iter(plans.values())).as_dense()
        return plans
