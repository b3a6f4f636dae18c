"""`sparseguard golden create|show|check`: golden sets of prompts with reference answers, and
an ad-hoc drift check that stores nothing (for measuring: the dense plan against itself and a
plan scaled to a target sparsity can join the calibrated levels)."""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

from tqdm import tqdm

from services.cli.common import emit, emit_json
from services.config import Settings
from services.shared.engine import build_engine
from services.workers.golden import compare, ensure_default_golden, freeze, runnable_levels
from services.workers.golden_set import load_golden, read_prompts, write_golden
from sparse_engine.data.corpora import load_texts
from sparse_engine.data.splits import evaluation_tokens
from sparse_engine.runtime.engine import Engine
from sparse_engine.sparsity.plan import Level, SparsityPlan
from sparse_engine.sparsity.scaled import scale_to_sparsity

log = logging.getLogger(__name__)
SCALE_TOKENS = 1024  # evaluation tokens the scaled plan's sparsity is measured on


def register(commands: Any) -> None:
    golden = commands.add_parser("golden", help="golden sets for the drift check").add_subparsers(
        dest="action", required=True
    )
    create = golden.add_parser(
        "create", help="freeze the dense model's answers as references (agreement, not quality)"
    )
    create.add_argument("--prompts", type=Path, required=True, help=".jsonl or text, one a line")
    create.add_argument("--out", type=Path, required=True, help="golden-set JSONL to write")
    create.add_argument("--max-new-tokens", type=int, help="answer length (default: settings)")
    create.add_argument("--model", help="model name, HF directory or GGUF file")
    create.add_argument("--force", action="store_true", help="replace an existing --out file")
    create.set_defaults(handler=create_golden)
    show = golden.add_parser("show", help="count a golden set's items by source and metric")
    show.add_argument("--file", type=Path, help="golden-set JSONL (default: settings)")
    show.set_defaults(handler=show_golden)
    check = golden.add_parser("check", help="drift per level now, printed as JSON, not stored")
    check.add_argument("--file", type=Path, help="golden-set JSONL (default: settings)")
    check.add_argument("--levels", help="comma-separated levels (default: settings)")
    check.add_argument("--limit", type=int, help="only the first N items")
    check.add_argument("--max-new-tokens", type=int, help="answer length (default: settings)")
    check.add_argument("--model", help="model name, HF directory or GGUF file")
    check.add_argument("--self-check", action="store_true", help="also dense against itself")
    check.add_argument("--scaled-sparsity", type=float, help="also LEVEL scaled to this sparsity")
    check.add_argument("--scaled-from", default="balanced", help="level to scale (balanced)")
    check.add_argument("--details", type=Path, help="also write per-item scores here (JSONL)")
    check.set_defaults(handler=check_golden)


def create_golden(args: argparse.Namespace, settings: Settings) -> int:
    if args.out.exists() and not args.force:
        raise ValueError(f"{args.out} exists; pass --force to replace its references")
    max_new_tokens = args.max_new_tokens or settings.jobs.golden_max_new_tokens
    prompts = read_prompts(args.prompts)  # before the model loads: fail fast on a bad file
    engine = build_engine(settings, args.model)  # the served decode path; dense answers only
    with tqdm(total=len(prompts), unit="prompt", desc="freezing dense answers") as bar:
        items = freeze(engine, prompts, max_new_tokens, progress=bar.update)
    write_golden(args.out, items)
    emit(f"wrote {len(items)} references from {engine.lm.model_id} to {args.out}")
    return 0


def show_golden(args: argparse.Namespace, settings: Settings) -> int:
    path: Path = args.file or settings.golden_set_path
    if not path.is_file():
        raise FileNotFoundError(
            f"no golden set at {path}; the first golden check builds the default from "
            "MT-Bench and HaluEval, or run `sparseguard golden create --prompts FILE --out FILE`"
        )
    items = load_golden(path)
    emit(f"{len(items)} items in {path}")
    for (source, metric), count in Counter((i.source, i.metric) for i in items).most_common():
        emit(f"  {count:5d}  {source} ({metric})")
    return 0


def check_golden(args: argparse.Namespace, settings: Settings) -> int:
    path = args.file or ensure_default_golden(settings)
    items = load_golden(path)[: args.limit]
    max_new_tokens = args.max_new_tokens or settings.jobs.golden_max_new_tokens
    levels = args.levels.split(",") if args.levels else settings.jobs.golden_levels
    engine = build_engine(settings, args.model)  # the served decode path, as the job runs
    plans = {level.value: engine.plans[level] for level in runnable_levels(engine, levels)}
    if args.self_check:
        plans["dense-self"] = SparsityPlan()
    if args.scaled_sparsity is not None:
        name, plan = _scaled(engine, settings, Level.parse(args.scaled_from), args.scaled_sparsity)
        plans[name] = plan
    started = time.perf_counter()
    with tqdm(total=len(items) * (1 + len(plans)), unit="answer", desc="golden check") as bar:
        results = compare(engine, items, plans, max_new_tokens, bar.update)
    if args.details is not None:
        rows = [{"level": r.level, **row} for r in results for row in r.details["items"]]
        args.details.write_text("".join(json.dumps(row) + "\n" for row in rows), "utf-8")
    budget = settings.signals.drift_budget
    levels_out = {r.level: {**r.figures(budget), "seconds": r.details["seconds"]} for r in results}
    emit_json(
        {
            "golden_set": str(path),
            "items": len(items),
            "budget": budget,
            "fast_path": engine.fast.dtype if engine.fast is not None else "off",
            "dense_seconds": results[0].details["dense_seconds"] if results else None,
            "seconds": round(time.perf_counter() - started, 1),
            "levels": levels_out,
        }
    )
    return 0


def _scaled(
    engine: Engine, settings: Settings, level: Level, target: float
) -> tuple[str, SparsityPlan]:
    """The level's plan scaled to `target` sparsity on evaluation tokens of the calibration
    corpus (unseen by calibration)."""
    texts = load_texts(settings.engine.calibration_corpus, settings.cache_home)
    ids = evaluation_tokens(engine.lm.tokenizer, texts, SCALE_TOKENS)
    plan = scale_to_sparsity(engine.lm, engine.plan(level), ids, target)
    return f"{level.value}-at-{target:.0%}", plan
