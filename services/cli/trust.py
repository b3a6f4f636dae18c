"""`sparseguard trust fit` and `sparseguard eval trust`: fit the trust model on graded QA
answers, and measure how well the trust score and each raw signal predict a wrong answer."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from tqdm import tqdm

from services.cli.common import emit, emit_json
from services.config import Settings
from services.shared.engine import build_engine
from sparse_engine.runtime.engine import Engine
from sparse_engine.sparsity.plan import Level
from sparse_engine.trust.evaluate import QARecord, RecordSet, collect
from sparse_engine.trust.model import TrustModel, TrustStore, fit
from sparse_engine.trust.qa import HALUEVAL, load_qa
from sparse_engine.trust.report import TrustReport, report

log = logging.getLogger(__name__)
EVAL_OFFSET = 5000  # evaluation reads HaluEval's second half; fitting starts at item 0


def register(commands: Any) -> None:
    trust = commands.add_parser("trust", help="the trust model").add_subparsers(
        dest="action", required=True
    )
    fitting = trust.add_parser("fit", help="fit the trust model on graded QA answers")
    _data_args(fitting, offset=0, n=600)
    fitting.add_argument(
        "--l2", type=float, help="L2 penalty on the weights (default: chosen by 5-fold CV)"
    )
    fitting.add_argument(
        "--if-missing", action="store_true", help="do nothing when a model for the level exists"
    )
    fitting.set_defaults(handler=fit_trust)
    evaluate = commands.add_parser("eval", help="evaluations").add_subparsers(
        dest="target", required=True
    )
    eval_trust = evaluate.add_parser("trust", help="AUROC of trust and signals for wrong answers")
    _data_args(eval_trust, offset=None, n=300)
    eval_trust.add_argument("--trust-model", help="trust model version (default: the latest)")
    eval_trust.add_argument("--json", action="store_true", help="print the report as JSON")
    eval_trust.set_defaults(handler=eval_trust_score)


def _data_args(parser: argparse.ArgumentParser, offset: int | None, n: int) -> None:
    parser.add_argument("--data", default=HALUEVAL, help="'halueval' or a QA JSONL file")
    parser.add_argument("--n", type=int, default=n, help="number of items")
    parser.add_argument(
        "--offset",
        type=int,
        default=offset,
        help=f"first item (default: {offset if offset is not None else EVAL_OFFSET} for "
        "halueval, 0 for a file)",
    )
    parser.add_argument("--level", default="balanced", help="sparsity level to answer at")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="answer length")
    parser.add_argument("--model", help="model name, HF directory or GGUF file")


def fit_trust(args: argparse.Namespace, settings: Settings) -> int:
    eng = build_engine(settings, args.model)
    if args.if_missing:
        try:
            found = TrustStore(settings.trust_dir).latest(eng.lm.model_id, args.level)
        except LookupError:
            pass
        else:
            emit(f"trust model {found.version} exists for {args.level}; nothing to do")
            return 0
    eng, records, level = _answers(args, settings, eng)
    model = fit(
        [r.signals for r in records],
        [r.correct for r in records],
        model_id=eng.lm.model_id,
        level=level.value,
        fit_data=_data_info(args, records),
        l2=args.l2,
        late_band=settings.signals.late_band,
    )
    model = TrustStore(settings.trust_dir).save(model)
    fitted = report(records, model, None, settings.signals.late_band)
    emit(
        f"trust model {model.version}: {len(records)} answers ({model.fit_data['right']} right), "
        f"in-sample AUROC {fitted.trust_auroc:.3f}; saved in {settings.trust_dir}"
    )
    return 0


def eval_trust_score(args: argparse.Namespace, settings: Settings) -> int:
    eng, records, _ = _answers(args, settings)
    model = _trust_model(args, settings, eng)
    result = report(records, model, _data_info(args, records), settings.signals.late_band)
    if args.json:
        emit_json(result.to_dict())
    else:
        _print(result)
    return 0


def _answers(
    args: argparse.Namespace, settings: Settings, eng: Engine | None = None
) -> tuple[Engine, list[QARecord], Level]:
    if args.n < 1:
        raise ValueError("--n must be at least 1")
    items = load_qa(args.data, settings.cache_home)  # before the model loads: fail fast
    offset = args.offset if args.offset is not None else _default_offset(args.data)
    if offset < 0 or offset + args.n > len(items):
        raise ValueError(
            f"{args.data} has {len(items)} items; --offset {offset} --n {args.n} "
            "reaches past the end"
        )
    level = Level.parse(args.level)
    eng = eng or build_engine(settings, args.model)
    plan = eng.plan(level)
    records_at = RecordSet(
        settings.trust_dir / "records",
        args.data,
        eng.lm.model_id,
        plan.calibration_version or "dense",
        args.max_new_tokens,
    )
    indices = range(offset, offset + args.n)
    with tqdm(total=args.n, unit="answer", desc=f"answering {args.data} at {level.value}") as bar:
        records = collect(eng, items, indices, level, records_at, progress=bar.update)
    args.offset = offset
    return eng, records, level


def _default_offset(data: str) -> int:
    return EVAL_OFFSET if data == HALUEVAL else 0


def _trust_model(args: argparse.Namespace, settings: Settings, eng: Engine) -> TrustModel | None:
    store = TrustStore(settings.trust_dir)
    if args.trust_model:
        return store.load(args.trust_model)
    try:
        return store.latest(eng.lm.model_id)
    except LookupError as exc:
        log.warning("%s; reporting the rule-based score", exc)
        return None


def _data_info(args: argparse.Namespace, records: list[QARecord]) -> dict[str, Any]:
    return {"data": args.data, "offset": args.offset, "n": len(records), "level": args.level}


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
