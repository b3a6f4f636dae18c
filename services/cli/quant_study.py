"""`sparseguard quant-silence`: what simulated int8 (the fast path's rule), 4-bit and fp8
weights do to the silent-channel set, to each calibrated level's realised sparsity and to
held-out perplexity, and whether lifting silent channels' reading weights by 1.5x before
quantising keeps them (`sparse_engine.compression.quant_silence` defines what is measured).

Silence is captured on calibration samples (the front of the corpus), perplexity and
sparsity on evaluation tokens from its middle (`data.splits`), which calibration never reads."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from typing import Any

from services.cli.common import emit, emit_json, store
from services.config import Settings
from services.shared.engine import load_served_model
from sparse_engine.calibration.pipeline import CalibrationConfig, prepare_data
from sparse_engine.calibration.store import CalibrationStore
from sparse_engine.compression.quant_silence import LIFT, QUANTISERS
from sparse_engine.compression.quant_survey import SurveyInputs, VariantResult, survey
from sparse_engine.data import corpora
from sparse_engine.data.splits import evaluation_tokens
from sparse_engine.model.loader import LoadedModel
from sparse_engine.sparsity.plan import Level, SparsityPlan

log = logging.getLogger(__name__)
DEFAULT_WEIGHTS = "int8,q4,fp8"


def register(commands: Any) -> None:
    cmd = commands.add_parser(
        "quant-silence",
        help="int8 / 4-bit / fp8 weights against silent channels, sparsity and perplexity",
    )
    cmd.add_argument("--model", help="model name, HF directory or GGUF file")
    cmd.add_argument("--data", help="corpus name or text file (default: settings)")
    cmd.add_argument("--samples", type=int, default=48, help="calibration samples (silence)")
    cmd.add_argument("--eval-tokens", type=int, default=4096, help="evaluation tokens")
    cmd.add_argument("--levels", help="comma-separated levels (default: every calibrated one)")
    cmd.add_argument("--weights", default=DEFAULT_WEIGHTS, help="comma-separated weight types")
    cmd.add_argument("--seq-len", type=int, help="tokens per calibration sample (settings)")
    cmd.add_argument("--lift", type=float, default=LIFT, help="factor on silent channels")
    cmd.add_argument(
        "--lift-quietest",
        type=float,
        default=0.0,
        help="also lift this share of each layer's quietest channels (the rule may flag none)",
    )
    cmd.add_argument("--json", action="store_true", help="print the figures as JSON")
    cmd.set_defaults(handler=run_quant_silence)


def check_args(args: argparse.Namespace) -> list[str]:
    """The weight types asked for; a ValueError that says what to change otherwise."""
    if args.samples < 1:
        raise ValueError("--samples must be at least 1")
    if args.seq_len is not None and args.seq_len < 32:
        raise ValueError("--seq-len must be at least 32 (a sample's minimum length)")
    if args.eval_tokens < 2:
        raise ValueError("--eval-tokens must be at least 2")
    if not args.lift > 0:
        raise ValueError("--lift must be a positive factor (the claim tested is 1.5)")
    if not 0.0 <= args.lift_quietest <= 1.0:
        raise ValueError("--lift-quietest is a share of channels between 0 and 1, e.g. 0.01")
    weights = [w.strip() for w in args.weights.split(",") if w.strip()]
    unknown = [w for w in weights if w not in QUANTISERS]
    if unknown or not weights:
        raise ValueError(f"--weights takes a comma-separated list of: {', '.join(QUANTISERS)}")
    for name in args.levels.split(",") if args.levels is not None else []:
        Level.parse(name)
    return weights


def level_plans(
    cals: CalibrationStore, weights_sha256: str, levels: str | None
) -> dict[str, SparsityPlan]:
    """Plans by level name, dense first: the levels asked for (each must be calibrated for
    these weights), or every calibrated level."""
    plans: dict[str, SparsityPlan] = {Level.DENSE.value: SparsityPlan()}
    if levels is None:
        found = cals.latest_plans(weights_sha256)
        plans.update({lv.value: p for lv, p in found.items() if lv is not Level.DENSE})
        if len(plans) == 1:
            log.warning("no calibrated level for these weights: measuring dense only")
        return plans
    for level in (Level.parse(name) for name in levels.split(",")):
        if level is not Level.DENSE:
            plans[level.value] = cals.latest(weights_sha256, level).plan()
    return plans


def run_quant_silence(args: argparse.Namespace, settings: Settings) -> int:
    weights = check_args(args)
    lm = load_served_model(settings, args.model)
    plans = level_plans(store(settings), lm.weights_sha256, args.levels)
    name = args.data or settings.engine.calibration_corpus
    texts = corpora.load_texts(name, settings.cache_home)
    seq_len = args.seq_len or settings.engine.seq_len
    inputs = survey_inputs(lm, texts, name, plans, args, seq_len)
    head = {"model": lm.model_id, "corpus": name, "samples": len(inputs.batches)}
    head |= {"eval_tokens": inputs.eval_tokens.numel(), "levels": list(plans)}
    head |= {"lift": inputs.factor, "lift_quietest": inputs.quiet_share}
    log.info("quant-silence: %s", head)
    results = survey(lm, inputs, weights, progress=lambda v: log.info("measuring %s", v))
    if args.json:
        emit_json({**head, "variants": [as_dict(r) for r in results]})
    else:
        emit(
            f"{lm.model_id} on {name}: {head['samples']} calibration samples, "
            f"{head['eval_tokens']} evaluation tokens, lift {inputs.factor:g}x on the rule's "
            f"silent channels + the quietest {100 * inputs.quiet_share:g}% per layer and kind"
        )
        emit(silence_table(results))
        emit(level_table(results))
    return 0


def survey_inputs(
    lm: LoadedModel,
    texts: list[str],
    name: str,
    plans: dict[str, SparsityPlan],
    args: argparse.Namespace,
    seq_len: int,
) -> SurveyInputs:
    """Calibration samples from the corpus's front (the held-out slice at its back is not
    used) and evaluation tokens from its middle, under the one split policy."""
    cfg = CalibrationConfig(samples=args.samples, seq_len=seq_len, heldout_tokens=1)
    data = prepare_data(lm.tokenizer, texts, cfg, name)
    tokens = evaluation_tokens(lm.tokenizer, texts, args.eval_tokens)
    if tokens.numel() < args.eval_tokens:
        raise ValueError(
            f"corpus '{name}' has only {tokens.numel()} evaluation tokens; lower --eval-tokens"
        )
    return SurveyInputs(
        data.batches, tokens, plans, factor=args.lift, quiet_share=args.lift_quietest
    )


def as_dict(result: VariantResult) -> dict[str, Any]:
    harm = result.damage
    data = dataclasses.asdict(result)
    data["damage"].update(
        zeroed_share=harm.zeroed_share,
        relative_error=harm.relative_error,
        all_zeroed_share=harm.all_zeroed_share,
        all_relative_error=harm.all_relative_error,
    )
    return data


def silence_table(results: list[VariantResult]) -> str:
    lines = [
        "(silent: by the rule, on the calibration samples; lifted: the channels the lift acts on)",
        "weights       silent  jaccard  woke  quieted | lifted: w zeroed  rel.err"
        " | all down, o: w zeroed  rel.err",
    ]
    for r in results:
        s, d = r.silent, r.damage
        same = f"  (weights = {r.same_as})" if r.same_as else ""
        lines.append(
            f"{r.name:12} {s.silent:7} {s.jaccard:8.3f} {s.woke:5} {s.quieted:8} | "
            f"{100 * d.zeroed_share:14.3f}% {d.relative_error:8.4f} | "
            f"{100 * d.all_zeroed_share:19.3f}% {d.all_relative_error:8.4f}{same}"
        )
    return "\n".join(lines)


def level_table(results: list[VariantResult]) -> str:
    lines = ["weights      level          sparsity  perplexity  change vs float32 dense"]
    for r in results:
        for level, lr in r.levels.items():
            lines.append(
                f"{r.name:12} {level:13} {lr.sparsity:9.4f} {lr.perplexity:11.4f}  "
                f"{lr.change_pct:+8.3f}% (+-{lr.change_se_pct:.3f})"
            )
    return "\n".join(lines)
