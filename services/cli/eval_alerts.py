"""`sparseguard eval alerts`: measure healthy and faulty requests on the real model, replay them
on event time through the real fold and alert evaluator, and report per rule (precision,
recall, detection and reset time) and per reason (share of healthy requests), as a table or
`--json`. Measured pools are kept under <home>/eval, keyed by the calibration versions, so a
rerun with other rule settings replays in seconds (`--remeasure` measures again)."""

from __future__ import annotations

import argparse
import hashlib
import logging
import pickle
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from alerts.rules import DEFAULT_RULES, load_rules
from services.cli.common import emit, emit_json, eval_commands, store
from services.cli.eval_report import render
from services.config import Settings
from services.gateway.reasons import BaselineBook
from services.gateway.trust import load_judge
from services.replay.measure import FAULTS, Measured, Measurer
from services.replay.replay import Calibrations
from services.replay.study import StudyConfig, run_study
from services.shared.engine import load_served_model
from sparse_engine.calibration.store import Calibration
from sparse_engine.model.loader import LoadedModel
from sparse_engine.sparsity.plan import Level

log = logging.getLogger(__name__)
POOL_FORMAT = 4  # 2: each kind behind the shared system prompt every other time; 3: reasons
# judged against the kinds of the request's category; 4: the data kind in the healthy mix


def register(commands: Any) -> None:
    cmd = eval_commands(commands).add_parser(
        "alerts", help="replay healthy and faulty telemetry through the alerts"
    )
    cmd.add_argument("--model", help="model name, HF directory or GGUF file (default: served)")
    cmd.add_argument("--healthy", type=int, default=100, help="measured requests per level")
    cmd.add_argument("--faulty", type=int, default=60, help="measured requests per fault")
    cmd.add_argument("--fault-level", default=Level.BALANCED.value)
    cmd.add_argument(
        "--fault-offset",
        type=int,
        default=0,
        help="draw the fault prompts from this far into each source (>= --healthy: disjoint "
        "from the healthy requests)",
    )
    cmd.add_argument("--rate", type=float, default=30.0, help="requests per minute per level")
    cmd.add_argument("--healthy-hours", type=float, default=2.0)
    cmd.add_argument("--faults", default=",".join(FAULTS), help="comma-separated fault names")
    cmd.add_argument("--remeasure", action="store_true", help="ignore the kept measurements")
    cmd.add_argument("--json", action="store_true", help="print the figures as JSON")
    cmd.set_defaults(handler=run_eval_alerts)


def run_eval_alerts(args: argparse.Namespace, settings: Settings) -> int:
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        raise ValueError(f"unknown faults {unknown}; choose from {', '.join(FAULTS)}")
    fault_level = Level.parse(args.fault_level)
    if args.fault_offset < 0:
        raise ValueError(f"--fault-offset must be 0 or more, got {args.fault_offset}")
    if fault_level is Level.DENSE:
        raise ValueError("inject faults at a sparse level (the dense level has no gate)")
    settings = with_model(settings, args.model)
    lm = load_served_model(settings)
    cals = latest_with_baselines(settings, lm)
    tokens = settings.engine.baseline_max_new_tokens
    measured_at = {int(c.baseline["max_new_tokens"]) for c in cals.values() if c.baseline}
    if measured_at != {tokens}:
        # Signals are means over the answer: measured 12 tokens against 16, gate-degraded
        # fired on 6.7-10 % of healthy requests instead of at most 1 % (README).
        log.warning(
            "the baselines were measured on answers of %s tokens, these requests get %d: "
            "set SPARSEGUARD_ENGINE__BASELINE_MAX_NEW_TOKENS to match, or the reasons' "
            "budgets will not hold",
            "/".join(map(str, sorted(measured_at))),
            tokens,
        )
    pools = _pools(args, settings, lm, [c.version for c in cals.values()], faults, fault_level)
    healthy, measured_faults = pools["healthy"], {f: pools["faults"][f] for f in faults}
    calibrations = Calibrations(
        targets={c.version: c.target_sparsity for c in cals.values()},
        baselines={c.version: c.baseline for c in cals.values()},
    )
    rules_file = settings.alerts.rules_file or DEFAULT_RULES
    rules = load_rules(rules_file, settings.signals.as_thresholds())
    drift_share = settings.engine.drift_sample_rate
    cfg = StudyConfig(args.rate, args.healthy_hours, fault_level.value, drift_share=drift_share)
    figures = run_study(settings, rules, healthy, measured_faults, calibrations, lm.model_id, cfg)
    figures["measured"] = {
        "healthy_per_level": args.healthy,
        "faulty_per_fault": args.faulty,
        "fault_offset": args.fault_offset,
        "calibrations": {c.level: c.version for c in cals.values()},
        "max_new_tokens": settings.engine.baseline_max_new_tokens,
    }
    if args.json:
        emit_json(figures)
    else:
        emit(render(figures, settings.signals.reason_budget))
    return 0


def with_model(settings: Settings, model: str | None) -> Settings:
    """Every part of a study (engine, trust model, baselines) on `model` (None: the served)."""
    if not model:
        return settings
    engine = settings.engine.model_copy(update={"model": model})
    return settings.model_copy(update={"engine": engine})


def latest_with_baselines(
    settings: Settings, lm: LoadedModel, levels: Sequence[Level] = ()
) -> dict[Level, Calibration]:
    """The latest calibration of each of `levels` (default: every sparse level) of `lm`; each
    must have its baseline."""
    wanted: list[Level] = [lv for lv in levels or _sparse_levels() if lv is not Level.DENSE]
    cals = {lv: store(settings).latest(lm.weights_sha256, lv) for lv in wanted}
    if any(c.baseline is None for c in cals.values()):
        raise ValueError(
            "the latest calibrations have no healthy baseline; run "
            "`sparseguard calibrations baseline` (or calibrate again)"
        )
    return cals


def _sparse_levels() -> list[Level]:
    return [lv for lv in Level if lv is not Level.DENSE]


def _pools(
    args: argparse.Namespace,
    settings: Settings,
    lm: Any,
    versions: list[str],
    faults: list[str],
    fault_level: Level,
) -> dict[str, Any]:
    judge = load_judge(settings, lm.model_id)
    judge.book = BaselineBook(store(settings))
    trust = [m.version for m in (judge.model, *judge.per_level.values()) if m is not None]
    path = _pool_path(settings, [*versions, *trust], args, fault_level)
    kept: dict[str, Any] = {"healthy": {}, "faults": {}}
    if path.is_file() and not args.remeasure:
        kept = pickle.loads(path.read_bytes())  # our own file, written below
    total = len(Level) * args.healthy * ("dense" not in kept["healthy"])
    total += args.faulty * sum(f not in kept["faults"] for f in faults)
    with tqdm(total=total, desc="measuring requests", unit="req") as bar:
        measurer = Measurer(settings, lm, judge, bar.update)
        for level in Level:
            if level.value not in kept["healthy"]:
                kept["healthy"][level.value] = _light(measurer.healthy(level, args.healthy))
        for fault in faults:
            if fault not in kept["faults"]:
                measured = measurer.fault(fault, fault_level, args.faulty, args.fault_offset)
                kept["faults"][fault] = _light(measured)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(pickle.dumps(kept))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(kept))
    return kept


def _pool_path(
    settings: Settings, versions: list[str], args: argparse.Namespace, level: Level
) -> Path:
    """Keyed by the calibration and trust model versions that judged the requests (a
    calibration re-measured with a new baseline, or a new trust model, measures again)."""
    name = hashlib.sha256(",".join(sorted(versions)).encode()).hexdigest()[:16]
    tokens = settings.engine.baseline_max_new_tokens
    return (
        settings.home
        / "eval"
        / f"alerts-v{POOL_FORMAT}-{name}-{args.healthy}x{args.faulty}+{args.fault_offset}"
        f"-{level.value}-{tokens}.pkl"
    )


def _light(measured: list[Measured]) -> list[Measured]:
    """Without the per-channel tensors (the trust judge has read them already)."""
    return [
        replace(m, stats=replace(m.stats, signals=replace(m.stats.signals, answer_channels=None)))
        if m.stats.signals is not None
        else m
        for m in measured
    ]
