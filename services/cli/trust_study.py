"""`sparseguard eval trust-matrix` and `eval trust-control`: does the trust score transfer?
The matrix fits a model on the fit half of each QA set and scores the eval half of every set
(the diagonal: in-domain, passage-disjoint), with the best baseline of each cell beside it. The
control scores, in proxy mode, each eval item's gold span against another span of its passage
of the same kind and length, where neither length nor containment can separate them."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from tqdm import tqdm

from services.cli.common import emit, emit_json, eval_commands
from services.cli.trust import answer_args, spec_of
from services.config import Settings
from services.shared.engine import build_engine
from services.workers.trust_fit import answers
from sparse_engine.data.qa_sets import QA_SETS
from sparse_engine.evaluation.ranking import auroc
from sparse_engine.sparsity.plan import Level
from sparse_engine.trust.evaluate import QARecord, RecordSet
from sparse_engine.trust.model import TrustModel, TrustStore, fit
from sparse_engine.trust.proxy import control_answers, score_given
from sparse_engine.trust.qa import load_qa, qa_sample
from sparse_engine.trust.report import BASELINES

log = logging.getLogger(__name__)


def register(commands: Any) -> None:
    evaluate = eval_commands(commands)
    matrix = evaluate.add_parser("trust-matrix", help="fit on each QA set, test on every set")
    _sets_args(matrix)
    matrix.set_defaults(handler=run_matrix)
    control = evaluate.add_parser(
        "trust-control", help="gold spans against length-matched wrong spans, in proxy mode"
    )
    _sets_args(control)
    control.add_argument("--trust-model", help="proxy-mode trust model (default: the latest)")
    control.set_defaults(handler=run_control)


def _sets_args(parser: argparse.ArgumentParser) -> None:
    answer_args(parser, n=200)
    parser.add_argument("--sets", default=",".join(QA_SETS), help="comma-separated QA sets")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def run_matrix(args: argparse.Namespace, settings: Settings) -> int:
    sets = _sets(args)
    eng = build_engine(settings, args.model)
    upstream = build_engine(settings, args.upstream) if args.upstream else None
    records: dict[tuple[str, str], list[QARecord]] = {}
    for name in sets:
        for split in ("fit", "eval"):
            spec = spec_of(argparse.Namespace(**{**vars(args), "data": name}), split)
            with tqdm(total=spec.n, unit="answer", desc=f"{name} ({split} half)") as bar:
                records[name, split] = answers(settings, eng, spec, bar.update, upstream)
    cells = []
    pools = {name: [name] for name in sets} | {"all": sets}
    pools |= {f"all but {name}": [s for s in sets if s != name] for name in sets}
    for train, members in pools.items():
        fitted = [r for name in members for r in records[name, "fit"]]
        model = fit(
            [r.signals for r in fitted],
            [r.correct for r in fitted],
            model_id=eng.lm.model_id,
            level=args.level,
            fit_data={"data": "+".join(members), "split": "fit"},
            late_band=settings.signals.late_band,
            mode=args.mode,
        )
        tests = [train.removeprefix("all but ")] if train.startswith("all but ") else sets
        for test in tests:
            cells.append({"fit": train, "test": test, **_judged(model, records[test, "eval"])})
    figures = {"mode": args.mode, "upstream": args.upstream, "level": args.level, "cells": cells}
    if args.json:
        emit_json(figures)
    else:
        _print_matrix(sets, cells)
    return 0


def run_control(args: argparse.Namespace, settings: Settings) -> int:
    eng = build_engine(settings, args.model)
    store = TrustStore(settings.trust_dir)
    model = (
        store.load(args.trust_model)
        if args.trust_model
        else store.latest(eng.lm.model_id, args.level, "proxy")
    )
    level = Level.parse(args.level)
    plan = eng.plan(level)
    rows = []
    for name in _sets(args):
        items = load_qa(name, settings.cache_home)
        given = control_answers(items, qa_sample(items, "eval", args.n))
        where = RecordSet(
            settings.trust_dir / "records",
            f"control-{name}",
            eng.lm.model_id,
            plan.calibration_version or "dense",
            args.max_new_tokens,
        )
        with tqdm(total=len(given), unit="answer", desc=f"control {name}") as bar:
            scored = score_given(eng, items, given, level, where, progress=bar.update)
        rows.append({"test": name, **_judged(model, scored)})
    figures = {"trust_model": model.version, "level": args.level, "rows": rows}
    if args.json:
        emit_json(figures)
    else:
        for row in rows:
            emit(_line(row["test"], row))
    return 0


def _judged(model: TrustModel, records: list[QARecord]) -> dict[str, Any]:
    """AUROC of the trust score for a wrong answer, and each baseline's in its better
    direction (chosen on these records, which favours the baselines)."""
    wrong = [not r.correct for r in records]
    trust = auroc([1 - model.score(r.signals) for r in records], wrong)
    baselines = {}
    for name, read in BASELINES.items():
        a = auroc([read(r) for r in records], wrong)
        baselines[name] = round(max(a, 1 - a), 4)
    best = max(baselines, key=lambda n: baselines[n])
    return {
        "n": len(records),
        "wrong": sum(wrong),
        "trust_auroc": round(trust, 4),
        "best_baseline": best,
        "best_baseline_auroc": baselines[best],
        "baselines": baselines,
    }


def _print_matrix(sets: list[str], cells: list[dict[str, Any]]) -> None:
    emit("trust AUROC for a wrong answer (fit on the row's fit half, tested on the column's eval")
    emit("half; the diagonal is in-domain, passage-disjoint; 'all' pools every set's fit half,")
    emit("'all but X' the others' and is tested on X); best baseline in brackets")
    width = max(len(s) for s in sets) + 10
    emit(" " * width + "".join(f"{s:>{width + 8}}" for s in sets))
    for train in dict.fromkeys(c["fit"] for c in cells):
        row = {c["test"]: c for c in cells if c["fit"] == train}
        emit(
            f"{train:<{width}}"
            + "".join(
                f"{row[s]['trust_auroc']:>{width}.3f} ({row[s]['best_baseline_auroc']:.3f})"
                if s in row
                else " " * (width + 8)
                for s in sets
            )
        )


def _line(name: str, row: dict[str, Any]) -> str:
    base = ", ".join(f"{k} {v:.3f}" for k, v in row["baselines"].items())
    return (
        f"{name}: {row['n']} answers ({row['wrong']} wrong), trust {row['trust_auroc']:.3f}; {base}"
    )


def _sets(args: argparse.Namespace) -> list[str]:
    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    unknown = sorted(set(sets) - set(QA_SETS))
    if unknown or not sets:
        raise ValueError(f"unknown QA sets {unknown}; choose from {', '.join(QA_SETS)}")
    return sets
