"""The alert study behind `sparseguard eval alerts`: measured pools in, every figure out.

Scenarios: `healthy` (every level, `healthy_hours` of held-out healthy traffic: no alert may
fire), one per fault (healthy warm-up, the fault on one level, healthy recovery), and
`unseen-kinds` (a baseline built from chat and code requests only, replayed on passage QA and
summaries: does a baseline generalise to traffic it never saw?)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from alerts.definitions import Rule
from services.config import Settings
from services.gateway.reasons import trust_reasons
from services.replay.measure import Measured
from services.replay.replay import Calibrations, Scenario, events, replay
from services.replay.scoring import FaultResult, Rate, fault_result, firings, rule_scores
from services.telemetry.schema import (
    REASON_GATE_DEGRADED,
    REASON_LOW_SCORE,
    REASON_MONOTONOUS_INPUT,
    REASON_SILENCE_SPIKE,
)
from sparse_engine.calibration.baseline import LevelBaseline, summarise
from sparse_engine.data.traffic import Prompt
from sparse_engine.sparsity.plan import Level
from sparse_engine.sparsity.signals import prompt_category
from sparse_engine.trust.features import from_stats

# The rule each fault is meant to raise.
INTENDED = {
    "miscalibrated": "GateConfidenceOutOfBand",
    "damaged": "LayerSparsityShift",
    "garbage": "SilenceSpikes",
    "templated": "SignalSpreadCollapsed",
    "multilingual": "GateConfidenceOutOfBand",
    "prefix-defeating": "PrefixCacheHitRateLow",
}
REASONS = (REASON_SILENCE_SPIKE, REASON_GATE_DEGRADED, REASON_MONOTONOUS_INPUT, REASON_LOW_SCORE)
BASELINE_REASONS = REASONS[:3]
UNSEEN_BASELINE_KINDS = ("chat", "code")
UNSEEN_CHECK_KINDS = ("qa", "summary")
WARMUP_S, FAULT_S, RECOVERY_S = 1800.0, 1200.0, 1800.0


@dataclass(frozen=True, slots=True)
class StudyConfig:
    rate_per_min: float = 30.0
    healthy_hours: float = 2.0
    fault_level: str = Level.BALANCED.value
    seed: int = 0
    drift_share: float = 1.0  # share of requests whose KL drift is measured (the gateway's)


def run_study(
    settings: Settings,
    rules: Sequence[Rule],
    healthy: Mapping[str, list[Measured]],
    faults: Mapping[str, list[Measured]],
    calibrations: Calibrations,
    model_id: str,
    cfg: StudyConfig,
) -> dict[str, Any]:
    signals = settings.signals
    names = [r.name for r in rules if r.window is not None]

    def run(
        scenario: Scenario,
        pools: Mapping[str, Sequence[Measured]],
        fault_pool: Sequence[Measured],
        cals: Calibrations,
    ) -> list[Any]:
        stream = events(
            scenario, pools, fault_pool, cfg.rate_per_min, model_id, cfg.seed, cfg.drift_share
        )
        return firings(scenario, replay(stream, rules, cals, signals, scenario.duration_s))

    runs: dict[str, tuple[Scenario, list[Any]]] = {}
    calm = Scenario("healthy", cfg.healthy_hours * 3600)
    runs["healthy"] = (calm, run(calm, healthy, [], calibrations))
    results: list[FaultResult] = []
    for fault, pool in faults.items():
        end = WARMUP_S + FAULT_S
        scenario = Scenario(fault, end + RECOVERY_S, fault, cfg.fault_level, WARMUP_S, end)
        runs[fault] = (scenario, run(scenario, healthy, pool, calibrations))
        results.append(fault_result(scenario, INTENDED[fault], runs[fault][1]))
    unseen, unseen_cals = _unseen(healthy, calibrations, settings)
    calm_unseen = Scenario("unseen-kinds", cfg.healthy_hours * 3600)
    unseen_firings = run(calm_unseen, unseen, [], unseen_cals)
    return {
        "config": {**asdict(cfg), "warmup_s": WARMUP_S, "fault_s": FAULT_S},
        "rules": [s.to_dict() for s in rule_scores(names, runs, results)],
        "faults": [asdict(r) for r in results],
        "healthy_alerts": [asdict(f) for f in runs["healthy"][1]],
        "reasons_healthy": _reason_rates(healthy),
        "reasons_faults": {f: _rates(pool, REASONS) for f, pool in faults.items()},
        "reasons_pooled": _rejudged_rates(healthy, faults, calibrations, settings, "pooled"),
        "reasons_every_kind": _rejudged_rates(
            healthy, faults, calibrations, settings, "every kind"
        ),
        "trust_actions_chat": {
            level: _action_rate([m for m in pool if m.kind == "chat"]).to_dict()
            for level, pool in healthy.items()
        },
        "unseen_kinds": {
            "baseline_kinds": list(UNSEEN_BASELINE_KINDS),
            "checked_kinds": list(UNSEEN_CHECK_KINDS),
            "alerts": [asdict(f) for f in unseen_firings],
            "reasons": {level: _rates(pool, BASELINE_REASONS) for level, pool in unseen.items()},
        },
    }


def _unseen(
    healthy: Mapping[str, list[Measured]], calibrations: Calibrations, settings: Settings
) -> tuple[dict[str, list[Measured]], Calibrations]:
    """QA and summary requests, re-judged against a baseline of the same level's chat and
    code requests (which then stands in for the calibration's)."""
    pools: dict[str, list[Measured]] = {}
    baselines = dict(calibrations.baselines)
    for level, pool in healthy.items():
        seen = [m for m in pool if m.kind in UNSEEN_BASELINE_KINDS]
        alt = summarise(
            Level.parse(level),
            [_prompt(m) for m in seen],
            [m.stats for m in seen],
            seen[0].stats.completion_tokens if seen else 1,
            settings.signals.late_band,
        )
        checked = [m for m in pool if m.kind in UNSEEN_CHECK_KINDS]
        pools[level] = [rejudge(m, alt, settings) for m in checked]
        for m in checked:
            if m.stats.calibration_version is not None:
                baselines[m.stats.calibration_version] = alt.to_dict()
    return pools, replace(calibrations, baselines=baselines)


def _rejudged_rates(
    healthy: Mapping[str, list[Measured]],
    faults: Mapping[str, list[Measured]],
    calibrations: Calibrations,
    settings: Settings,
    test: str,
) -> dict[str, Any]:
    """The reasons of the sparse levels' requests had each been tested another way, on the
    same requests: `pooled`, against its baseline's pooled sample (every kind together), or
    `every kind`, against each kind's sample whatever the request's category. What the
    per-kind and per-category tests cost in detection and save on healthy kinds."""

    def rejudged(pool: Sequence[Measured]) -> list[Measured]:
        found = []
        for m in pool:
            data = calibrations.baselines.get(m.stats.calibration_version or "")
            if data is None:  # a dense request has no calibration
                continue
            baseline = LevelBaseline.from_dict(dict(data))
            if test == "pooled":
                found.append(rejudge(m, baseline.pooled(), settings))
            else:
                found.append(rejudge(m, baseline, settings, categorised=False))
        return found

    sparse = {
        level: rejudged(pool) for level, pool in healthy.items() if level != Level.DENSE.value
    }
    return {
        "healthy": _reason_rates(sparse),
        "faults": {f: _rates(rejudged(pool), BASELINE_REASONS) for f, pool in faults.items()},
    }


def _prompt(m: Measured) -> Prompt:
    return Prompt(m.kind, m.prompt)


def rejudge(
    m: Measured,
    baseline: LevelBaseline,
    settings: Settings,
    categorised: bool = True,
    sided: bool = True,
) -> Measured:
    """`m` with its baseline reasons judged again against `baseline`: against the kinds of its
    category, or (`categorised` False) against every kind; on its side of the system prompt,
    or (`sided` False) against the kinds' samples as measured."""
    sig = from_stats(m.stats, m.prompt)
    kept = tuple(r for r in m.trust.reasons if r not in BASELINE_REASONS)
    dense = m.level == "dense"
    category = prompt_category(m.prompt) if categorised else None
    found = trust_reasons(
        sig, 1.0, settings.signals, 0.0, dense, baseline, category=category,
        system=m.system if sided else None,
    )  # fmt: skip
    reasons = tuple(r for r in found if r in BASELINE_REASONS) + kept
    return replace(m, trust=replace(m.trust, reasons=reasons))


def _reason_rates(healthy: Mapping[str, list[Measured]]) -> dict[str, Any]:
    by_level = {level: _rates(pool, REASONS) for level, pool in healthy.items()}
    kinds = sorted({m.kind for pool in healthy.values() for m in pool})
    by_kind = {
        kind: _rates([m for pool in healthy.values() for m in pool if m.kind == kind], REASONS)
        for kind in kinds
    }
    return {"by_level": by_level, "by_kind": by_kind}


def _rates(pool: Sequence[Measured], reasons: Sequence[str]) -> dict[str, Any]:
    return {r: Rate(sum(r in m.trust.reasons for m in pool), len(pool)).to_dict() for r in reasons}


def _action_rate(pool: Sequence[Measured]) -> Rate:
    return Rate(sum(m.trust.action != "none" for m in pool), len(pool))
