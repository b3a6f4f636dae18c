"""`sparseguard calibrate` and `sparseguard calibrations list|show`."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from tqdm import tqdm

from services.cli.common import emit, emit_json, store
from services.config import Settings
from services.shared import baseline
from services.shared.engine import load_served_model
from services.shared.ranges import healthy_ranges, ranges_table
from services.storage.db import make_engine, session_factory, upgrade
from services.storage.repository import calibration_row, upsert_calibration
from sparse_engine.calibration.baseline import LevelBaseline
from sparse_engine.calibration.pipeline import CalibrationConfig, calibrate, prepare_data
from sparse_engine.calibration.store import Calibration
from sparse_engine.data import corpora
from sparse_engine.model.catalog import resolve_model
from sparse_engine.model.loader import LoadedModel
from sparse_engine.model.model_dir import weights_sha256
from sparse_engine.sparsity.plan import SPARSE_LEVELS, Level

log = logging.getLogger(__name__)


def register(commands: Any) -> None:
    cal = commands.add_parser("calibrate", help="calibrate sparsity levels for a model")
    cal.add_argument("--model", help="model name, HF directory or GGUF file")
    cal.add_argument("--data", help="corpus name or text file (default: settings)")
    cal.add_argument("--samples", type=int, help="calibration samples (default: settings)")
    cal.add_argument("--heldout-tokens", type=int, help="held-out tokens for perplexity")
    cal.add_argument("--level", action="append", help="level to calibrate (repeatable, or 'all')")
    cal.add_argument("--sparsifier", choices=["threshold", "topk", "gates"], default="threshold")
    cal.add_argument("--gates", help="gate artefact (.safetensors) for --sparsifier gates")
    cal.add_argument("--roles", default="down", help="projections to sparsify, e.g. down,o,q,k,v")
    cal.add_argument("--if-missing", action="store_true", help="skip levels already calibrated")
    cal.add_argument(
        "--per-source",
        action=argparse.BooleanOptionalAction,
        help="with a mixed corpus (A+B): held-out text from each part in equal shares, and each "
        "level's bound taken on every part alone, the worst kept (default: on for a mixed "
        "corpus, SPARSEGUARD_ENGINE__CALIBRATION_PER_SOURCE)",
    )
    cal.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the healthy baseline pass (alarms then fall back to the published numbers)",
    )
    cal.set_defaults(handler=run_calibrate)

    cals = commands.add_parser("calibrations", help="calibration artefacts").add_subparsers(
        dest="action", required=True
    )
    cals.add_parser("list", help="list calibration versions").set_defaults(
        handler=list_calibrations
    )
    base = cals.add_parser(
        "baseline", help="measure the healthy baseline of the latest calibration per level"
    )
    base.add_argument("--level", action="append", help="level (repeatable, or 'all'; default all)")
    base.add_argument("--model", help="model name, HF directory or GGUF file")
    base.set_defaults(handler=run_baseline)
    show = cals.add_parser("show", help="show one calibration as JSON")
    show.add_argument("version")
    show.set_defaults(handler=show_calibration)
    ranges = cals.add_parser(
        "ranges", help="each level's healthy range per signal, from the latest baselines"
    )
    ranges.add_argument("--model", help="model name, HF directory or GGUF file")
    ranges.add_argument("--json", action="store_true", help="print the ranges as JSON")
    ranges.set_defaults(handler=show_ranges)


def run_calibrate(args: argparse.Namespace, settings: Settings) -> int:
    if (args.gates is None) != (args.sparsifier != "gates"):
        raise ValueError("--gates FILE goes with --sparsifier gates, and only with it")
    name = args.data or settings.engine.calibration_corpus
    asked = args.per_source  # None: the settings decide
    per_source = settings.engine.per_source_for(name) if asked is None else asked
    if per_source and "+" not in name:
        raise ValueError(
            f"--per-source takes a bound on each part of a mixed corpus, and '{name}' has one "
            "part: pass --data with parts joined by '+', e.g. --data wiki+c4+technical"
        )
    levels = parse_levels(args.level or [settings.engine.default_level])
    lm = load_served_model(settings, args.model)
    if args.if_missing:
        done = {c.level for c in store(settings).list(lm.weights_sha256)}
        levels = [lv for lv in levels if lv.value not in done]
        if not levels:
            log.info("every requested level is already calibrated for %s", lm.model_id)
            return 0
    cfg = CalibrationConfig(
        samples=args.samples or settings.engine.calibration_samples,
        seq_len=settings.engine.seq_len,
        sensitivity_tokens=settings.engine.sensitivity_tokens,
        heldout_tokens=args.heldout_tokens or settings.engine.heldout_tokens,
        sparsifier=args.sparsifier,
        roles=tuple(r.strip() for r in args.roles.split(",") if r.strip()),
        gates_path=args.gates,
    )
    texts, sources = corpora.load_sourced(name, settings.cache_home, per_source)
    data = prepare_data(lm.tokenizer, texts, cfg, name, sources)
    total = sum(b.numel() for b in data.batches)
    with tqdm(total=total, unit="tok", desc="collecting activation statistics") as bar:
        results = calibrate(lm, data, levels, cfg, progress=bar.update)
    keep(settings, lm, results, with_baseline=not args.no_baseline)
    return 0


def keep(
    settings: Settings, lm: LoadedModel, results: list[Calibration], with_baseline: bool
) -> None:
    """Save new calibrations, measure their healthy baselines, register them in SQL."""
    for cal in results:
        store(settings).save(cal)
    if with_baseline:
        baseline.attach(settings, lm, results)
    for cal in results:
        store(settings).save(cal)
        record_calibration(settings, cal, reason="cli")
        emit(describe(cal))


def run_baseline(args: argparse.Namespace, settings: Settings) -> int:
    """Measure baselines for calibrations made without one (or again, after a change)."""
    levels = parse_levels(args.level or ["all"])
    lm = load_served_model(settings, args.model)
    cals = [store(settings).latest(lm.weights_sha256, level) for level in levels]
    baseline.attach(settings, lm, cals)
    for cal in cals:
        store(settings).save(cal)
        record_calibration(settings, cal, reason="cli")
        measured = LevelBaseline.from_dict(cal.baseline or {})
        emit(f"{cal.version}  {cal.level:12} baseline: {baseline.describe(measured)}")
    return 0


def record_calibration(settings: Settings, cal: Calibration, reason: str) -> None:
    """Register the version in SQL, where the aggregator reads each level's target."""
    upgrade(settings.database_url)
    with session_factory(make_engine(settings.database_url)).begin() as session:
        upsert_calibration(session, calibration_row(cal, reason))


def parse_levels(values: list[str]) -> list[Level]:
    if "all" in values:
        return list(SPARSE_LEVELS)
    levels = [Level.parse(v) for v in values]
    if Level.DENSE in levels:
        raise ValueError(
            "the dense level needs no calibration; choose conservative, balanced or aggressive"
        )
    return levels


def describe(cal: Calibration) -> str:
    """One line: the level, its sparsity and perplexity change, and the upper bound that met
    the budget (with parts, the part it was taken on); calibrations stored before the bound
    was kept show none."""
    bound, parts = cal.data.get("bound_pct"), cal.data.get("part_bounds_pct") or {}
    worst = f" {max(parts, key=parts.__getitem__)}" if parts else ""
    met = f", bound {bound:+.2f}%{worst}" if bound is not None else ""
    return (
        f"{cal.version}  {cal.level:12} sparsity {cal.realised_sparsity:.3f}  "
        f"ppl {cal.perplexity_dense:.2f} -> {cal.perplexity_sparse:.2f} "
        f"({cal.perplexity_change_pct:+.2f}%{met}, budget {cal.budget_pct}%)  "
        f"data {cal.data.get('corpus')}"
    )


def list_calibrations(args: argparse.Namespace, settings: Settings) -> int:
    found = store(settings).list()
    if not found:
        emit("no calibrations yet; run `sparseguard calibrate --level balanced`")
    for cal in found:
        emit(describe(cal))
    return 0


def show_calibration(args: argparse.Namespace, settings: Settings) -> int:
    emit_json(store(settings).load(args.version).to_dict())
    return 0


def show_ranges(args: argparse.Namespace, settings: Settings) -> int:
    """The healthy range of every baseline signal at dense and each calibrated level."""
    model = args.model or settings.engine.model
    sha = weights_sha256(resolve_model(model, settings.cache_home))
    found = healthy_ranges(store(settings).list(sha))
    if not found:
        raise ValueError(
            f"no calibration of {model} has a healthy baseline; run `sparseguard calibrate "
            f"--model {model} --level all` (or `sparseguard calibrations baseline`)"
        )
    if args.json:
        emit_json(found)
    else:
        emit(ranges_table(found))
    return 0
