"""`sparseguard eval trust-matrix`, `eval trust-curve` and `eval trust-control`: does the trust
score transfer? The matrix fits a model on the fit half of each QA set and scores the eval half
of every set (the diagonal: in-domain, passage-disjoint), with the best baseline of each cell
beside it. The curve refits the pooled models on growing fit halves: is the limit the data? The
control scores, in proxy mode, each eval item's gold span against another span of its passage
of the same kind and length, where neither length nor containment can separate them."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from tqdm import tqdm

from services.cli.common import emit, emit_json, eval_commands
from services.cli.curve_render import render_curves
from services.cli.trust import answer_args, spec_of
from services.config import Settings
from services.shared.engine import build_engine
from services.workers.trust_fit import answers
from sparse_engine.data.qa_sets import QA_SETS
from sparse_engine.evaluation.ranking import auroc
from sparse_engine.runtime.engine import Engine
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
    matrix.add_argument("--fit-n", type=int, help="items of each fit half (default: --n)")
    matrix.set_defaults(handler=run_matrix)
    curve = evaluate.add_parser(
        "trust-curve", help="trust AUROC of the pooled fits against the fit answers per set"
    )
    _sets_args(curve)
    curve.add_argument(
        "--sizes", help="fit items per set, comma-separated, each <= --n (default: n/4,n/2,n)"
    )
    curve.add_argument("--plot", type=Path, help="write the curves to this PNG")
    curve.set_defaults(handler=run_curve)
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
    sets, fit_n = _sets(args), _fit_n(args)
    eng = build_engine(settings, args.model)
    upstream = build_engine(settings, args.upstream) if args.upstream else None
    evals = {name: _records(args, settings, eng, upstream, name, "eval", args.n) for name in sets}
    fits = {name: _records(args, settings, eng, upstream, name, "fit", fit_n) for name in sets}
    pools = {name: ([name], sets) for name in sets} | _pooled(sets)
    cells = [
        {"fit": train, "test": test, **_judged(model, evals[test])}
        for train, (members, tests) in pools.items()
        for model in [_fit(args, settings, eng, fits, members)]
        for test in tests
    ]
    figures = {
        "mode": args.mode,
        "upstream": args.upstream,
        "level": args.level,
        "eval_n": args.n,
        "fit_n": fit_n,
        "cells": cells,
    }
    if args.json:
        emit_json(figures)
    else:
        _print_matrix(sets, cells)
    return 0


def run_curve(args: argparse.Namespace, settings: Settings) -> int:
    """The pooled fits ('all' and 'all but X') on n/4, n/2 and n fit items of every set (the
    smaller samples are subsets of the larger), each tested on the same eval halves."""
    sets, sizes = _sets(args), _sizes(args)
    eng = build_engine(settings, args.model)
    upstream = build_engine(settings, args.upstream) if args.upstream else None
    evals = {name: _records(args, settings, eng, upstream, name, "eval", args.n) for name in sets}
    points = []
    for size in sizes:
        fits = {name: _records(args, settings, eng, upstream, name, "fit", size) for name in sets}
        for train, (members, tests) in _pooled(sets).items():
            model = _fit(args, settings, eng, fits, members)
            for test in tests:
                points.append(
                    {
                        "size": size,
                        "fit_answers": sum(len(fits[m]) for m in members),
                        "fit": train,
                        "cv_auroc": model.fit_data["cv_auroc"],
                        "test": test,
                        **_judged(model, evals[test]),
                    }
                )
    figures = {"mode": args.mode, "level": args.level, "eval_n": args.n, "points": points}
    if args.plot:
        written = _plot(args.plot, sets, points)
        if args.json:  # stdout stays one JSON document
            log.info("curves written to %s", written)
        else:
            emit(f"curves written to {written}")
    if args.json:
        emit_json(figures)
    else:
        _print_curve(sets, points)
    return 0


def _records(
    args: argparse.Namespace,
    settings: Settings,
    eng: Engine,
    upstream: Engine | None,
    name: str,
    split: str,
    n: int,
) -> list[QARecord]:
    spec = spec_of(argparse.Namespace(**{**vars(args), "data": name, "n": n}), split)
    with tqdm(total=spec.n, unit="answer", desc=f"{name} ({split} half, n={n})") as bar:
        return answers(settings, eng, spec, bar.update, upstream)


def _pooled(sets: list[str]) -> dict[str, tuple[list[str], list[str]]]:
    """Pooled fits, name -> (the sets fit on, the sets tested on): every set's fit half, tested
    on every set; every set's but one, tested on that one."""
    pools = {"all": (sets, sets)}
    return pools | {f"all but {name}": ([s for s in sets if s != name], [name]) for name in sets}


def _fit(
    args: argparse.Namespace,
    settings: Settings,
    eng: Engine,
    fits: dict[str, list[QARecord]],
    members: list[str],
) -> TrustModel:
    fitted = [r for name in members for r in fits[name]]
    return fit(
        [r.signals for r in fitted],
        [r.correct for r in fitted],
        model_id=eng.lm.model_id,
        level=args.level,
        fit_data={"data": "+".join(members), "split": "fit"},
        late_band=settings.signals.late_band,
        mode=args.mode,
    )


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


def _print_curve(sets: list[str], points: list[dict[str, Any]]) -> None:
    emit("trust AUROC for a wrong answer against the fit items per set (pooled fit halves;")
    emit("'all but X' is tested on X only); cross-validated AUROC of the fit and the eval half's")
    emit("best baseline in brackets")
    for p in points:
        emit(
            f"{p['size']:>5} per set ({p['fit_answers']:>5} answers)  fit {p['fit']:<26} "
            f"cv {p['cv_auroc']:.3f}  test {p['test']:<20} {p['trust_auroc']:.3f} "
            f"({p['best_baseline_auroc']:.3f} {p['best_baseline']})"
        )


def _plot(path: Path, sets: list[str], points: list[dict[str, Any]]) -> Path:
    panels: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for test in sets:
        mine = [p for p in points if p["test"] == test]
        lines: dict[str, list[tuple[float, float]]] = {"fit on all": [], "fit on the others": []}
        for p in mine:
            line = "fit on all" if p["fit"] == "all" else "fit on the others"
            lines[line].append((p["size"], p["trust_auroc"]))
        best = mine[0]["best_baseline_auroc"] if mine else 0.5
        lines["best baseline"] = [(p["size"], best) for p in mine if p["fit"] == "all"]
        panels[test] = lines
    return render_curves(
        path, "trust AUROC for a wrong answer (eval halves)", panels, xlabel="fit items per set"
    )


def _fit_n(args: argparse.Namespace) -> int:
    if args.fit_n is None:
        return int(args.n)
    if args.fit_n < 1:
        raise ValueError(f"--fit-n must be at least 1, got {args.fit_n}")
    return int(args.fit_n)


def _sizes(args: argparse.Namespace) -> list[int]:
    if args.sizes is None:
        return sorted({max(1, args.n // 4), max(1, args.n // 2), args.n})
    try:
        sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
    except ValueError:
        raise ValueError(
            f"--sizes takes whole numbers separated by commas, not {args.sizes!r}"
        ) from None
    if not sizes or sizes[0] < 1 or sizes[-1] > args.n:
        raise ValueError(f"--sizes must lie between 1 and --n ({args.n}), got {args.sizes!r}")
    return sizes


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
