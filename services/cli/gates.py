"""`sparseguard train-gates`: train learned gates on the frozen served model, write the
versioned gate artefact (tensors, JSON record, training curve PNG), calibrate the level on it,
and compare it with the level's threshold plan on evaluation text neither has seen."""

from __future__ import annotations

import argparse
import logging
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from services.cli.calibration import keep, parse_levels
from services.cli.common import emit, emit_json, store
from services.cli.curve_render import render_curves
from services.config import Settings
from services.shared.engine import load_served_model
from sparse_engine.calibration.pipeline import CalibrationConfig, calibrate, prepare_data
from sparse_engine.calibration.store import Calibration
from sparse_engine.data import corpora
from sparse_engine.data.splits import evaluation_tokens
from sparse_engine.evaluation.perplexity import perplexity
from sparse_engine.jsonstore import stamped_version
from sparse_engine.model.loader import LoadedModel
from sparse_engine.sparsity.plan import Level, SparsityPlan
from sparse_engine.training.gate_fit import local_error
from sparse_engine.training.train_gates import CurvePoint, GateTraining, TrainedGates, train_gates

log = logging.getLogger(__name__)


def register(commands: Any) -> None:
    cmd = commands.add_parser("train-gates", help="train learned gates and calibrate a level")
    cmd.add_argument("--model", help="model name, HF directory or GGUF file")
    cmd.add_argument("--level", default="balanced", help="the level to calibrate the gates for")
    cmd.add_argument("--data", help="corpus name or text file (default: settings)")
    defaults = GateTraining()
    cmd.add_argument("--steps", type=int, default=defaults.steps)
    cmd.add_argument("--batch", type=int, default=defaults.batch, help="sequences per step")
    cmd.add_argument("--seq-len", type=int, default=defaults.seq_len, help="tokens per sequence")
    cmd.add_argument("--rank", type=int, help=f"rank of each gate matrix (default {defaults.rank})")
    cmd.add_argument("--target-sparsity", type=float, default=defaults.target)
    cmd.add_argument(
        "--init",
        default=defaults.init,
        help="open (every gate open), fit (closed-form fit to the channels' magnitudes) or a "
        "gate artefact to go on from (with --steps 0: only calibrate and judge it)",
    )
    cmd.add_argument("--samples", type=int, default=400, help="training documents")
    cmd.add_argument("--eval-tokens", type=int, default=4096, help="evaluation tokens")
    cmd.add_argument("--no-baseline", action="store_true", help="skip the healthy baseline pass")
    cmd.add_argument("--json", action="store_true", help="print the report as JSON")
    cmd.set_defaults(handler=run_train)


def run_train(args: argparse.Namespace, settings: Settings) -> int:
    (level,) = parse_levels([args.level])
    defaults = GateTraining()
    cfg = GateTraining(
        steps=args.steps,
        batch=args.batch,
        seq_len=args.seq_len,
        rank=defaults.rank if args.rank is None else args.rank,
        target=args.target_sparsity,
        init=args.init,
        eval_every=max(1, args.steps // 10),
    )
    cfg.check()
    if cfg.resumes and args.rank is not None:
        raise ValueError("--rank does not apply to --init FILE: the artefact's rank is kept")
    if args.samples < 1 or args.eval_tokens < 2:
        raise ValueError("--samples must be >= 1 and --eval-tokens >= 2")
    lm = load_served_model(settings, args.model)
    name = args.data or settings.engine.calibration_corpus
    texts, sources = corpora.load_sourced(
        name, settings.cache_home, settings.engine.per_source_for(name)
    )
    split = CalibrationConfig(
        samples=args.samples,
        seq_len=cfg.seq_len,
        min_tokens=cfg.seq_len,
        heldout_tokens=settings.engine.heldout_tokens // 2,
    )
    data = prepare_data(lm.tokenizer, texts, split, name)
    sequences = [b[0, len(data.prefix) :] for b in data.batches]
    trained = _train(lm, sequences, data.heldout, data.prefix, cfg)
    same = cfg.resumes and cfg.steps == 0
    path = Path(cfg.init) if same else _save(settings, lm, trained, cfg, name)
    cal_cfg = CalibrationConfig(
        samples=settings.engine.calibration_samples,
        seq_len=settings.engine.seq_len,
        heldout_tokens=settings.engine.heldout_tokens,
        sparsifier="gates",
        gates_path=str(path),
    )
    cal_data = prepare_data(lm.tokenizer, texts, cal_cfg, name, sources)  # as `calibrate`
    results = calibrate(lm, cal_data, [level], cal_cfg)
    keep(settings, lm, results, with_baseline=not args.no_baseline)
    report = _compare(
        settings, lm, results[0], evaluation_tokens(lm.tokenizer, texts, args.eval_tokens)
    )
    report |= {
        "gates": str(path),
        "curve": str(path.with_suffix(".png")) if trained.curve else None,
        "train_s": trained.seconds,
    }
    if args.json:
        emit_json(report)
    else:
        for key, value in report.items():
            if not key.startswith("local_error"):
                emit(f"{key:28} {value}")
        for key in ("local_error_calibrated", "local_error_trained"):
            _show(key, report[key])
    return 0


def _train(
    lm: LoadedModel,
    sequences: list[torch.Tensor],
    heldout: torch.Tensor,
    prefix: tuple[int, ...],
    cfg: GateTraining,
) -> TrainedGates:
    with tqdm(total=cfg.steps, unit="step", desc="training gates") as bar:

        def show(point: CurvePoint) -> None:
            shown = {"loss": f"{point.loss:.3f}", "sparsity": f"{point.sparsity:.3f}"}
            if point.heldout_ppl is not None:
                shown["heldout_ppl"] = f"{point.heldout_ppl:.2f}"
            bar.set_postfix(shown)
            bar.update(1)

        return train_gates(lm, sequences, heldout, cfg, prefix, progress=show)


def _save(
    settings: Settings, lm: LoadedModel, trained: TrainedGates, cfg: GateTraining, data: str
) -> Path:
    created = datetime.now(UTC).isoformat(timespec="seconds")
    slug = re.sub(r"[^a-z0-9]+", "-", lm.model_id.lower()).strip("-")
    setup = {"weights_sha256": lm.weights_sha256, "config": _config(cfg), "data": data}
    trained.gates.version = stamped_version(f"{slug}-gates", created, setup)
    path = settings.calibrations_dir / "gates" / f"{trained.gates.version}.safetensors"
    record = {
        "model_id": lm.model_id,
        "created_at": created,
        **setup,
        "dense_heldout_ppl": trained.dense_ppl,
        "train_s": round(trained.seconds, 1),
        "curve": [p.to_dict() for p in trained.curve],
    }
    trained.gates.save(path, record)
    if trained.curve:
        _render(path.with_suffix(".png"), trained)
    log.info("gate artefact %s written (%d steps)", path, cfg.steps)
    return path


def _config(cfg: GateTraining) -> dict[str, Any]:
    return {name: getattr(cfg, name) for name in cfg.__slots__}


def _render(path: Path, trained: TrainedGates) -> None:
    judged = [p for p in trained.curve if p.heldout_ppl is not None]
    render_curves(
        path,
        f"gate training ({trained.seconds / 60:.1f} min)",
        {
            "distillation KL (train batch)": {"KL": [(p.step, p.kl) for p in trained.curve]},
            "channel sparsity": {
                "train batch": [(p.step, p.sparsity) for p in trained.curve],
                "held-out": [(p.step, p.heldout_sparsity or 0.0) for p in judged],
            },
            "held-out perplexity": {
                "gated": [(p.step, p.heldout_ppl or 0.0) for p in judged],
                "dense": [(p.step, trained.dense_ppl) for p in judged],
            },
        },
    )


def _compare(
    settings: Settings, lm: LoadedModel, cal: Calibration, tokens: torch.Tensor
) -> dict[str, Any]:
    """The gate plan, the dense model and (if calibrated) the level's threshold plan on the
    same evaluation tokens, disjoint from training, calibration and its held-out text."""
    plans = {"dense": SparsityPlan(), "gates": cal.plan()}
    threshold = _threshold_plan(settings, lm, Level.parse(cal.level))
    if threshold is not None:
        plans["threshold"] = threshold
    report: dict[str, Any] = {"calibration": cal.version, "level": cal.level}
    dense = None
    for name, plan in plans.items():
        result = perplexity(lm.model, lm.layers, tokens, plan, prefix=tuple(lm.bos_prefix))
        dense = dense or result.perplexity
        report[f"{name}_sparsity"] = round(result.sparsity, 4)
        report[f"{name}_ppl_change_pct"] = round(100 * (result.perplexity / dense - 1), 3)
    report["eval_tokens"] = int(tokens.numel())
    report |= _why(lm, cal, tokens)
    return report


def _why(lm: LoadedModel, cal: Calibration, tokens: torch.Tensor) -> dict[str, Any]:
    """The gates' closed channels against as many closed by magnitude in each layer: the share
    of each MLP's output they carry (the local error), at the calibrated offset and at the
    offset the gates were trained at (0), mean over the layers and layer by layer."""
    plan = cal.plan()
    assert plan.gates is not None
    width = 128
    usable = tokens[: tokens.numel() // width * width].view(-1, width)
    head = torch.tensor(lm.bos_prefix, dtype=tokens.dtype).expand(usable.shape[0], -1)
    full = torch.cat([head, usable], dim=1)
    rows = [full[i : i + 8] for i in range(0, full.shape[0], 8)]
    report: dict[str, Any] = {}
    for name, offset in (("calibrated", plan.gate_offset), ("trained", 0.0)):
        errors = local_error(lm, plan.gates, offset, rows)
        count = len(errors)
        report[f"local_error_{name}"] = {
            "sparsity": round(sum(e.sparsity for e in errors) / count, 4),
            "gates": round(sum(e.gates for e in errors) / count, 5),
            "magnitude": round(sum(e.magnitude for e in errors) / count, 5),
            "layers": [e.to_dict() for e in errors],
        }
    return report


def _threshold_plan(settings: Settings, lm: LoadedModel, level: Level) -> SparsityPlan | None:
    found = [
        c
        for c in store(settings).list(lm.weights_sha256)
        if c.level == level.value and c.sparsifier == "threshold"
    ]
    if not found:
        log.info("no threshold calibration of %s to compare with", level.value)
        return None
    return found[-1].plan()


def _show(key: str, found: dict[str, Any]) -> None:
    emit(
        f"{key}: mean over layers at sparsity {found['sparsity']:.3f}: gates "
        f"{found['gates']:.5f}, by magnitude {found['magnitude']:.5f}"
    )
    for e in found["layers"]:
        emit(
            f"  layer {e['layer']:3} sparsity {e['sparsity']:.3f}  gates {e['gates']:.5f}  "
            f"magnitude {e['magnitude']:.5f}"
        )
