"""The baseline pass that ends a calibration (CLI and recalibration job): healthy held-out
prompts through the engine as served with the new plans, at each new level and at dense, and
each level's baseline stored in its artefact (`Calibration.baseline`, `.dense_baseline`).
Each level is kept as it is measured (`<home>/baseline-progress`), so an interrupted pass,
run again, resumes at the level it stopped in; the kept levels go once the pass ends."""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from services.config import Settings
from services.shared.engine import build_engine
from sparse_engine.calibration.baseline import LevelBaseline, run_prompts, summarise
from sparse_engine.calibration.conformal import binomial_tail, sample_needed
from sparse_engine.calibration.store import Calibration
from sparse_engine.data import traffic
from sparse_engine.jsonstore import JsonStore
from sparse_engine.model.loader import LoadedModel
from sparse_engine.sparsity.plan import Level

log = logging.getLogger(__name__)


def baseline_prompts(settings: Settings) -> list[traffic.Prompt]:
    """The baseline half of the configured healthy kinds, every other prompt of each kind
    behind the shared system prompt."""
    cfg = settings.engine
    kinds = tuple(cfg.baseline_kinds)
    prompts = traffic.mix(
        kinds, settings.cache_home, "baseline", cfg.baseline_requests, at_most=True
    )
    asked = -(-cfg.baseline_requests // len(kinds))
    counts = Counter(p.kind for p in prompts)
    for kind in kinds:
        if counts[kind] < asked:
            log.warning(
                "the %s corpus's baseline half holds %d prompts, fewer than the %d asked: "
                "its sample is all of them",
                kind,
                counts[kind],
                asked,
            )
    per_kind = min(counts[kind] for kind in kinds)
    budget, confidence = settings.signals.reason_budget, settings.signals.reason_confidence
    if (per_kind + 1) * budget < 1:
        log.warning(
            "%d baseline requests a kind cannot hold a %.1f %% reason budget on each kind "
            "(the reasons fall back to the pooled sample): set "
            "SPARSEGUARD_ENGINE__BASELINE_REQUESTS to %d or more",
            per_kind,
            100 * budget,
            len(kinds) * (math.ceil(1 / budget) - 1),
        )
    elif per_kind < sample_needed(budget, confidence):
        log.warning(
            "%d baseline requests a kind hold the %.1f %% reason budget on average, and with "
            "%.0f %% confidence (%.0f %% asked: SPARSEGUARD_ENGINE__BASELINE_REQUESTS=%d)",
            per_kind,
            100 * budget,
            100 * binomial_tail(per_kind, budget, 1),
            100 * confidence,
            len(kinds) * sample_needed(budget, confidence),
        )
    return traffic.half_with_system(prompts)


def measure(
    settings: Settings, lm: LoadedModel, levels: Sequence[Level], prompts: list[traffic.Prompt]
) -> dict[Level, LevelBaseline]:
    """Each level's baseline on the engine as served (the calibrations of `levels` must be
    in the store already: the engine loads the latest plans). A level an interrupted pass
    kept, under the same plan, prompts and settings, is taken as kept."""
    engine = build_engine(settings, lm, prefix_cache=True)
    tokens = settings.engine.baseline_max_new_tokens
    kept = JsonStore(progress_dir(settings))
    found = {}
    with tqdm(total=len(levels) * len(prompts), desc="baseline pass", unit="req") as bar:
        for level in levels:
            key = _progress_key(settings, lm, engine.plan(level).calibration_version, prompts)
            earlier = kept.load(key)
            if earlier is not None:
                found[level] = LevelBaseline.from_dict(earlier)
                log.info("%s baseline: kept from an interrupted pass (%s)", level.value, key)
                bar.update(len(prompts))
                continue
            answers = run_prompts(
                engine,
                level,
                prompts,
                tokens,
                progress=bar.update,
                drift_share=settings.engine.baseline_drift_share,
            )
            found[level] = summarise(level, prompts, answers, tokens, settings.signals.late_band)
            kept.save(key, found[level].to_dict())
            log.info("%s baseline: %s", level.value, describe(found[level]))
    return found


def attach(settings: Settings, lm: LoadedModel, cals: Sequence[Calibration]) -> int:
    """Measure and store the baselines of `cals` (saved already) and of the dense level;
    the requests it sent. The levels kept for resuming go once the baselines are attached."""
    levels = [Level.parse(c.level) for c in cals]
    prompts = baseline_prompts(settings)
    found = measure(settings, lm, [Level.DENSE, *levels], prompts)
    dense = found[Level.DENSE].to_dict()
    for cal, level in zip(cals, levels, strict=True):
        cal.baseline = found[level].to_dict()
        cal.dense_baseline = dense
    for version in (None, *(c.version for c in cals)):
        (progress_dir(settings) / f"{_progress_key(settings, lm, version, prompts)}.json").unlink(
            missing_ok=True
        )
    return (len(levels) + 1) * len(prompts)


def progress_dir(settings: Settings) -> Path:
    return settings.home / "baseline-progress"


def _progress_key(
    settings: Settings, lm: LoadedModel, version: str | None, prompts: list[traffic.Prompt]
) -> str:
    """What decides a level's baseline: the weights, the plan (its calibration; None: dense),
    the prompts and the engine's and signals' settings."""
    decides = {
        "weights": lm.weights_sha256,
        "calibration": version,
        "prompts": [[p.kind, p.messages()] for p in prompts],
        "engine": settings.engine.model_dump(mode="json"),
        "late_band": settings.signals.late_band,
    }
    digest = hashlib.sha256(json.dumps(decides, sort_keys=True).encode()).hexdigest()[:16]
    return f"{version or 'dense'}-{digest}"


def describe(baseline: LevelBaseline) -> str:
    parts = [f"{baseline.requests} requests"]
    for name, stats in baseline.signals.items():
        parts.append(f"{name} {stats.median:.3f} (sd {stats.sd:.3f}, tol {stats.tolerance:.3f})")
    return "; ".join(parts)
