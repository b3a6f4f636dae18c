"""`sparseguard trust fit` and `sparseguard eval trust`: fit the trust model on graded QA
answers in the foreground (the same fit as the worker's `trust_fit` job, which `sparseguard up`
queues), and measure how well the trust score and each raw signal predict a wrong answer."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from tqdm import tqdm

from services.cli.common import emit, emit_json, eval_commands
from services.config import Settings
from services.shared.engine import build_engine
from services.workers.trust_fit import FitSpec, answers, existing, fit_models, healthy_answers
from sparse_engine.data.qa_sets import QA_SETS
from sparse_engine.runtime.engine import Engine
from sparse_engine.sparsity.plan import Level
from sparse_engine.sparsity.signals import TEXT
from sparse_engine.trust.flagging import flag_threshold
from sparse_engine.trust.model import MODES, TrustModel, TrustStore
from sparse_engine.trust.qa import HALUEVAL, SPLITS
from sparse_engine.trust.report import TrustReport, report

log = logging.getLogger(__name__)


def register(commands: Any) -> None:
    trust = commands.add_parser("trust", help="the trust model").add_subparsers(
        dest="action", required=True
    )
    fitting = trust.add_parser("fit", help="fit the trust model on graded QA answers")
    data_args(fitting, n=200, many_levels=True)
    fitting.add_argument(
        "--l2", type=float, help="L2 penalty on the weights (default: chosen by 5-fold CV)"
    )
    fitting.add_argument(
        "--if-missing", action="store_true", help="skip the levels that have a model"
    )
    fitting.set_defaults(handler=fit_trust)
    evaluate = eval_commands(commands)
    eval_trust = evaluate.add_parser("trust", help="AUROC of trust and signals for wrong answers")
    data_args(eval_trust, n=200)
    eval_trust.add_argument(
        "--split", choices=SPLITS, default="eval", help="half of the set (default: eval)"
    )
    eval_trust.add_argument("--trust-model", help="trust model version (default: the latest)")
    eval_trust.add_argument("--json", action="store_true", help="print the report as JSON")
    eval_trust.set_defaults(handler=eval_trust_score)


def data_args(parser: argparse.ArgumentParser, n: int, many_levels: bool = False) -> None:
    parser.add_argument(
        "--data", default=HALUEVAL, help=f"{', '.join(QA_SETS)}, or a QA JSONL file"
    )
    answer_args(parser, n, many_levels)


def answer_args(parser: argparse.ArgumentParser, n: int, many_levels: bool = False) -> None:
    """How items are answered and scored: the arguments every trust command shares.
    `many_levels`: --level takes several (a fit makes one model each)."""
    parser.add_argument("--n", type=int, default=n, help="items (about; from one half of the set)")
    level_help = (
        "sparsity level to answer at, or several joined by ',' (one model each, fit in that "
        "order); 'all': every served level not named before it (e.g. balanced,all)"
        if many_levels
        else "sparsity level to answer at"
    )
    parser.add_argument("--level", default="balanced", help=level_help)
    parser.add_argument("--max-new-tokens", type=int, default=32, help="answer length")
    parser.add_argument("--model", help="model name, HF directory or GGUF file")
    parser.add_argument(
        "--mode",
        choices=MODES,
        default="serve",
        help="serve: the model's own answers; proxy: answers scored teacher-forced, as the "
        "gateway's proxy mode does; closed: the model's own answers to the questions without "
        "their passages (for a route that retrieves: SPARSEGUARD_TRUST__ROUTE_MODES)",
    )
    parser.add_argument(
        "--upstream",
        help="proxy mode: the model whose answers are scored (default: the model's own)",
    )


def fit_trust(args: argparse.Namespace, settings: Settings) -> int:
    spec = spec_of(args, "fit", many_levels=True)
    eng = build_engine(settings, args.model)
    levels = spec.levels(eng.plans)
    if args.if_missing:
        have = existing(settings, eng.lm.model_id, [level.value for level in levels], spec.mode)
        for level, found in have.items():
            emit(f"trust model {found.version} exists for {level}; skipped")
        levels = [level for level in levels if level.value not in have]
    if not levels:
        return 0
    fitted_at = set()
    with _bar(spec, levels, healthy_answers(settings, eng)) as bar:
        for model, records in fit_models(settings, eng, spec, levels, progress=bar.update):
            fitted_at.add(model.level)
            fitted = report(records, model, None, settings.signals.late_band)
            data = model.fit_data
            emit(
                f"trust model {model.version} at {model.level}: {len(records)} answers "
                f"({data['right']} right); groups {', '.join(model.group_names)}; "
                f"cross-validated AUROC {data['cv_auroc']} (nested, choice included: "
                f"{data['nested_auroc']}; chance reaches {data['chance_auroc']}), "
                f"in-sample {fitted.trust_auroc:.3f}; saved in {settings.trust_dir}"
            )
    unfit = [level.value for level in levels if level.value not in fitted_at]
    if unfit:
        emit(f"no trust model at {', '.join(unfit)}: see the warnings above (more items: --n)")
    return 1 if unfit else 0


def eval_trust_score(args: argparse.Namespace, settings: Settings) -> int:
    spec = spec_of(args, args.split)
    eng = build_engine(settings, args.model)
    with _bar(spec) as bar:
        records = answers(settings, eng, spec, progress=bar.update)
    model = _trust_model(args, settings, eng, spec.mode)
    info = {"data": spec.data, "split": spec.split, "n": len(records), "level": spec.level}
    flag_below = flag_threshold(model, spec.level, TEXT) if model else None  # as a question
    result = report(records, model, info, settings.signals.late_band, flag_below)
    if args.json:
        emit_json(result.to_dict())
    else:
        _print(result)
    return 0


def spec_of(args: argparse.Namespace, split: str, many_levels: bool = False) -> FitSpec:
    """The fit or evaluation spec of the arguments (bad ones fail before the model loads);
    `many_levels`: --level may name several."""
    if args.n < 1:
        raise ValueError("--n must be at least 1")
    if args.upstream and args.mode != "proxy":
        raise ValueError("--upstream scores another model's answers: add --mode proxy")
    return FitSpec(
        data=args.data,
        n=args.n,
        split=split,
        level=args.level if many_levels else Level.parse(args.level).value,
        max_new_tokens=args.max_new_tokens,
        l2=getattr(args, "l2", None),
        model=args.model,
        mode=args.mode,
        upstream=args.upstream,
    )


def _bar(spec: FitSpec, levels: list[Level] | None = None, healthy: int = 0) -> tqdm[Any]:
    """`levels`: those a fit answers at (default: the spec's one); `healthy`: the healthy
    answers of the flag thresholds, after the first level's items."""
    named = [level.value for level in levels] if levels else [spec.level]
    then = ", and healthy prompts at every level" if healthy else ""
    desc = f"answering {spec.data} at {','.join(named)}{then}"
    return tqdm(total=spec.n * len(named) + healthy, unit="answer", desc=desc)


def _trust_model(
    args: argparse.Namespace, settings: Settings, eng: Engine, mode: str
) -> TrustModel | None:
    store = TrustStore(settings.trust_dir)
    if args.trust_model:
        return store.load(args.trust_model)
    try:
        return store.latest(eng.lm.model_id, args.level, mode)
    except LookupError as exc:
        log.warning("%s; reporting the rule-based score", exc)
        return None


def _print(r: TrustReport) -> None:
    emit(
        f"{r.n} answers, {r.right} right ({100 * r.right / r.n:.1f}%), mean F1 {r.mean_f1:.3f}; "
        f"trust model {r.trust_model or 'none (rule-based score)'}"
        + ("" if r.held_out is None else f"; held out: {'yes' if r.held_out else 'NO'}")
    )
    emit(f"{'score':<22}{'kind':<10}{'AUROC':>7}  higher on wrong answers?")
    for row in r.rows:
        emit(f"{row.name:<22}{row.kind:<10}{row.auroc:>7.3f}  {row.direction}")
    emit(
        f"trust score AUROC {r.trust_auroc:.3f}; best baseline {r.best_baseline} "
        f"{r.best_baseline_auroc:.3f}; margin {r.trust_auroc - r.best_baseline_auroc:+.3f}"
    )
    emit(
        f"late-layer silence: {r.silence_wrong:.4f} on wrong answers vs {r.silence_right:.4f} "
        f"on right ones ({r.silence_moves})"
    )
    if r.mean_trust is not None and r.brier is not None:
        emit(
            f"mean trust score {r.mean_trust:.3f} against {r.right / r.n:.3f} right; Brier score "
            f"{r.brier:.4f} (saying the share right for every answer: {r.brier_reference:.4f})"
        )
    if r.flag_threshold is not None:
        wrong = r.n - r.right
        emit(
            f"flagged below the level's threshold for text ({r.flag_threshold:.3g}): "
            f"{r.flagged_wrong} of {wrong} wrong answers, {r.flagged_right} of {r.right} right"
        )
