"""Made-up healthy baselines the baseline, reasons, baseline-book and hot-reload tests share."""

from __future__ import annotations

import random

from sparse_engine.calibration.baseline import LevelBaseline, SignalBaseline


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
