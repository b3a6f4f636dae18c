"""`sparseguard finetune`: fine-tune the served model (its MLP weights) on a corpus or text
file with the learned-sparsity aids as options, measure the share of MLP weights below 1e-4
and the held-out perplexity before and after, and write the result as a new model directory."""

from __future__ import annotations

import argparse
import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tqdm import tqdm

from services.cli.common import emit, emit_json
from services.config import Settings
from services.shared.engine import load_served_model
from sparse_engine.data import corpora
from sparse_engine.data.splits import evaluation_tokens
from sparse_engine.evaluation.perplexity import perplexity
from sparse_engine.model.loader import LoadedModel
from sparse_engine.sparsity.plan import SparsityPlan
from sparse_engine.training.finetune import (
    DEFAULT_ALPHA,
    FinetuneConfig,
    FinetuneResult,
    finetune,
    save_finetuned,
    training_windows,
)

log = logging.getLogger(__name__)


def register(commands: Any) -> None:
    cmd = commands.add_parser("finetune", help="fine-tune the MLPs with the sparsity aids")
    cmd.add_argument("--data", required=True, help="corpus name or text/.jsonl file")
    cmd.add_argument("--model", help="model name, HF directory or GGUF file")
    cmd.add_argument("--steps", type=int, default=100, help="optimiser steps")
    cmd.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate")
    cmd.add_argument("--batch-size", type=int, default=2, help="windows per step")
    cmd.add_argument("--seq-len", type=int, default=64, help="tokens per window")
    cmd.add_argument(
        "--l1-grw", type=float, nargs="?", const=DEFAULT_ALPHA, metavar="ALPHA",
        help=f"L1 gradient re-weighting with this alpha (alone: {DEFAULT_ALPHA})",
    )  # fmt: skip
    cmd.add_argument("--l1-lambda", type=float, default=1e-3, help="L1-GRW strength lambda")
    cmd.add_argument("--head-kl", type=float, default=0.0, metavar="LAMBDA", help="head KL weight")
    cmd.add_argument(
        "--recalibrate-silence-every", type=int, default=0, metavar="N",
        help="re-capture silent channels every N steps and mask them (0: off)",
    )  # fmt: skip
    cmd.add_argument("--silence-samples", type=int, default=8, help="windows per re-capture")
    cmd.add_argument("--protect-last", type=int, default=3, help="last layers never masked")
    cmd.add_argument("--eval-tokens", type=int, default=2048, help="held-out tokens scored")
    cmd.add_argument("--out", type=Path, help="new model directory (default: under home)")
    cmd.add_argument("--json", action="store_true", help="print the report as JSON")
    cmd.set_defaults(handler=run_finetune)


def config_of(args: argparse.Namespace) -> FinetuneConfig:
    cfg = FinetuneConfig(
        steps=args.steps,
        lr=args.lr,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        l1_alpha=args.l1_grw,
        l1_lambda=args.l1_lambda,
        head_kl=args.head_kl,
        recalibrate_every=args.recalibrate_silence_every,
        silence_samples=args.silence_samples,
        protect_last=args.protect_last,
    )
    cfg.check()
    if args.eval_tokens < 16:
        raise ValueError(f"--eval-tokens must be >= 16 (got {args.eval_tokens})")
    return cfg


def check_out(out: Path | None) -> None:
    if out is not None and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty directory; choose a new --out")


def run_finetune(args: argparse.Namespace, settings: Settings) -> int:
    cfg = config_of(args)
    check_out(args.out)
    texts = corpora.load_texts(args.data, settings.cache_home)
    lm = load_served_model(settings, args.model)
    windows = training_windows(lm.tokenizer, texts, cfg.seq_len, cfg.windows_needed)
    heldout = evaluation_tokens(lm.tokenizer, texts, args.eval_tokens)
    before = held_out_perplexity(lm, heldout)
    with tqdm(total=cfg.steps, unit="step", desc="fine-tuning") as bar:

        def progress(step: int, loss: float) -> None:
            bar.set_postfix(loss=f"{loss:.3f}")
            bar.update(1)

        result = finetune(lm, windows, cfg, progress)
    after = held_out_perplexity(lm, heldout)
    report = build_report(lm, args.data, result, before, after, heldout.numel())
    out = args.out or default_out(settings, lm)
    report["weights_sha256"] = save_finetuned(lm, out, report)
    report["out"] = str(out)
    emit_json(report) if args.json else emit(summary(report))
    return 0


def held_out_perplexity(lm: LoadedModel, heldout: Any) -> float:
    result = perplexity(lm.model, lm.layers, heldout, SparsityPlan(), prefix=lm.bos_prefix)
    return result.perplexity


def default_out(settings: Settings, lm: LoadedModel) -> Path:
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return settings.home / "finetuned" / f"{lm.model_id}-ft-{stamp}"


def build_report(
    lm: LoadedModel, data: str, result: FinetuneResult, before: float, after: float, tokens: int
) -> dict[str, Any]:
    report = result.to_dict()
    report.update(
        base_model=lm.model_id,
        base_weights_sha256=lm.weights_sha256,
        data=data,
        heldout_tokens=tokens,
        perplexity_before=before,
        perplexity_after=after,
        perplexity_change_pct=100.0 * (after / before - 1.0),
    )
    return report


def summary(report: dict[str, Any]) -> str:
    cfg = report["config"]
    aids = [f"l1-grw alpha={cfg['l1_alpha']} lambda={cfg['l1_lambda']}"] if cfg["l1_alpha"] else []
    aids += [f"head-kl {cfg['head_kl']}"] if cfg["head_kl"] else []
    aids += [f"silence every {cfg['recalibrate_every']}"] if cfg["recalibrate_every"] else []
    lines = [
        f"fine-tuned {report['base_model']} on {report['data']}: {cfg['steps']} steps in "
        f"{report['seconds']:.0f}s ({', '.join(aids) or 'no aids'})",
        f"  loss {report['losses'][0]:.3f} -> {report['losses'][-1]:.3f}",
        f"  MLP weights |w| < {cfg['tiny_eps']:g}: {100 * report['tiny_share_before']:.3f}% -> "
        f"{100 * report['tiny_share_after']:.3f}%",
        f"  held-out perplexity ({report['heldout_tokens']} tokens): "
        f"{report['perplexity_before']:.3f} -> {report['perplexity_after']:.3f} "
        f"({report['perplexity_change_pct']:+.2f}%)",
    ]
    for row in report["drift"][1:]:
        woke = sum(len(v) for v in row["woke"].values())
        quiet = sum(len(v) for v in row["quiet"].values())
        lines.append(f"  silence at step {row['step']}: {woke} woke up, {quiet} went quiet")
    lines.append(f"wrote {report['out']}")
    return "\n".join(lines)
