"""Made-up healthy baselines (and a calibration to hold them) the baseline, reasons,
baseline-book, ranges, replay and hot-reload tests share."""

from __future__ import annotations

import random

from sparse_engine.calibration.baseline import LevelBaseline, SignalBaseline
from sparse_engine.calibration.store import Calibration

CALIBRATION = Calibration(  # balanced, no thresholds; give it weights and a baseline
    model_id="m",
    weights_sha256="w",
    level="balanced",
    sparsifier="threshold",
    thresholds={},
    topk=None,
    silence_thresholds=[],
    target_sparsity=0.5,
    realised_sparsity=0.5,
    perplexity_dense=10.0,
    perplexity_sparse=10.1,
    budget_pct=2.0,
    data={},
    duration_s=0.0,
)


def baseline_of(values: dict[str, list[float]], kinds: int = 2) -> LevelBaseline:
    """A baseline whose signals hold `values`, split round-robin over `kinds` kinds."""
    signals = {
        name: SignalBaseline.of({f"k{k}": vs[k::kinds] for k in range(kinds)})
        for name, vs in values.items()
    }
    n = len(next(iter(values.values())))
    return LevelBaseline("balanced", n, [f"k{k}" for k in range(kinds)], 16, signals)


def healthy_level() -> LevelBaseline:
    rng = random.Random(5)
    return baseline_of(
        {
            "late_silence": [rng.uniform(0.80, 0.90) for _ in range(200)],
            "gate_entropy": [rng.uniform(0.96, 0.98) for _ in range(200)],
            "gate_confidence": [rng.uniform(0.94, 0.97) for _ in range(200)],
        }
    )
