"""`sparseguard eval reasons`: held-out prompts of one healthy kind through the engine as served,
judged by the gateway's trust judge, and per level the share of them each reason fired on,
with the prompts it fired on. Does a reason hold its budget on that kind, measured on more
distinct prompts than the alert study's mix gives one kind (24 at `--healthy 120`)?"""

from __future__ import annotations

import argparse
from typing import Any

from tqdm import tqdm

from services.cli.common import emit, emit_json, eval_commands, store
from services.cli.eval_alerts import latest_with_baselines, with_model
from services.cli.eval_report import rate_text
from services.config import Settings
from services.gateway.reasons import BaselineBook
from services.gateway.trust import load_judge
from services.replay.measure import Measured, Measurer
from services.replay.scoring import Rate
from services.replay.study import BASELINE_REASONS, REASONS, rejudge
from services.shared.engine import load_served_model
from sparse_engine.calibration.baseline import LevelBaseline
from sparse_engine.data import traffic
from sparse_engine.sparsity.plan import Level
from sparse_engine.sparsity.signals import prompt_category


def register(commands: Any) -> None:
    cmd = eval_commands(commands).add_parser(
        "reasons", help="per-request reasons on one healthy kind's held-out prompts"
    )
    cmd.add_argument("--kind", required=True, choices=traffic.HEALTHY_KINDS)
    cmd.add_argument("--count", type=int, default=100, help="held-out prompts of the kind")
    cmd.add_argument(
        "--levels", default="all", help="comma-separated levels, or all (default: all)"
    )
    cmd.add_argument("--model", help="model name, HF directory or GGUF file (default: served)")
    cmd.add_argument("--json", action="store_true", help="print the figures as JSON")
    cmd.set_defaults(handler=run_eval_reasons)


def run_eval_reasons(args: argparse.Namespace, settings: Settings) -> int:
    if args.count < 1:
        raise ValueError(f"--count must be 1 or more, got {args.count}")
    names = [n.strip() for n in args.levels.split(",") if n.strip()]
    levels = list(Level) if names == ["all"] else [Level.parse(n) for n in names]
    settings = with_model(settings, args.model)
    prompts = traffic.healthy(args.kind, settings.cache_home, "evaluation", args.count)
    prompts = traffic.half_with_system(prompts)  # as the baseline pass and the study send them
    lm = load_served_model(settings)
    cals = latest_with_baselines(settings, lm, levels)  # only the levels measured
    baselines = {lv.value: LevelBaseline.from_dict(c.baseline or {}) for lv, c in cals.items()}
    judge = load_judge(settings, lm.model_id)
    judge.book = BaselineBook(store(settings))
    with tqdm(total=len(levels) * len(prompts), desc="measuring requests", unit="req") as bar:
        measurer = Measurer(settings, lm, judge, bar.update)
        measured = {level.value: measurer.answer(level, prompts) for level in levels}
    every_kind = {  # the sparse levels' requests, against every kind whatever their category
        level: [rejudge(m, baselines[level], settings, categorised=False) for m in pool]
        for level, pool in measured.items()
        if level in baselines
    }
    unsided = {  # the same, against the kinds' samples as measured, whatever their side
        level: [rejudge(m, baselines[level], settings, sided=False) for m in pool]
        for level, pool in measured.items()
        if level in baselines
    }
    figures = reason_figures(
        args.kind, measured, settings.signals.reason_budget, every_kind, unsided
    )
    if args.json:
        emit_json(figures)
    else:
        emit(render(figures))
    return 0


def reason_figures(
    kind: str,
    measured: dict[str, list[Measured]],
    budget: float,
    every_kind: dict[str, list[Measured]] | None = None,
    unsided: dict[str, list[Measured]] | None = None,
) -> dict[str, Any]:
    """Per level and over all levels, each reason's share of the requests; per reason, the
    prompts it fired on (with their category, side of the system prompt and the levels); the
    shares over all levels of the requests with and without the system prompt; the same
    shares for `every_kind`, the requests judged again against every kind, and by side for
    `unsided`, judged again whatever their side."""
    every = [m for pool in measured.values() for m in pool]
    rows = dict(measured) | {"all levels": every}
    again = every_kind or {}
    again_rows = dict(again) | {"all these levels": [m for p in again.values() for m in p]}
    fired: dict[str, dict[str, list[str]]] = {}
    behind = {m.prompt: m.system for m in every}
    for m in every:
        for reason in m.trust.reasons:
            fired.setdefault(reason, {}).setdefault(m.prompt, []).append(m.level)
    sides = {"system prompt": True, "no system prompt": False}
    again_unsided = [m for pool in (unsided or {}).values() for m in pool]
    return {
        "kind": kind,
        "prompts": len(next(iter(measured.values()), [])),
        "budget": budget,
        "rates": {row: _rates(pool, REASONS) for row, pool in rows.items()},
        "rates_by_side": {
            side: _rates([m for m in every if m.system is system], REASONS)
            for side, system in sides.items()
        },
        "rates_by_side_unsided": {
            side: _rates([m for m in again_unsided if m.system is system], BASELINE_REASONS)
            for side, system in sides.items()
        },
        "rates_every_kind": {
            row: _rates(pool, BASELINE_REASONS) for row, pool in again_rows.items()
        },
        "fired_on": {
            reason: [
                {"prompt": p, "category": prompt_category(p), "system": behind[p], "levels": lv}
                for p, lv in sorted(by_prompt.items(), key=lambda item: -len(item[1]))
            ]
            for reason, by_prompt in sorted(fired.items())
        },
    }


def _rates(pool: list[Measured], reasons: tuple[str, ...]) -> dict[str, Any]:
    return {r: Rate(sum(r in m.trust.reasons for m in pool), len(pool)).to_dict() for r in reasons}


def render(figures: dict[str, Any]) -> str:
    lines = [
        f"{figures['prompts']} held-out {figures['kind']} prompts a level; reason budget "
        f"{figures['budget']:.0%} (95% interval)",
        f"{'':<14}" + "".join(f"{r:<28}" for r in REASONS),
    ]
    lines += _rows(figures["rates"], REASONS, 14)
    lines += ["", "All levels' requests by their side of the system prompt"]
    lines += _rows(figures["rates_by_side"], REASONS, 18)
    lines += ["", "The sparse levels' requests by side, judged whatever their side"]
    lines += _rows(figures["rates_by_side_unsided"], BASELINE_REASONS, 18)
    lines += ["", "The sparse levels' requests against every kind, whatever their category"]
    lines += _rows(figures["rates_every_kind"], BASELINE_REASONS, 18)
    for reason, prompts in figures["fired_on"].items():
        lines += ["", f"{reason}: {len(prompts)} distinct prompts"]
        for p in prompts:
            text = " ".join(p["prompt"].split())[:90]
            side = "system" if p["system"] else "plain"
            lines.append(f"  [{p['category']}, {side}; {','.join(p['levels'])}] {text}")
    return "\n".join(lines)


def _rows(table: dict[str, Any], reasons: tuple[str, ...], width: int) -> list[str]:
    return [
        f"{row:<{width}}" + "".join(f"{rate_text(rates[r]):<28}" for r in reasons)
        for row, rates in table.items()
    ]
