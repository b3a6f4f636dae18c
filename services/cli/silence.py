"""`sparseguard silence-map` (capture, rule, ablation, rendered artefacts) and
`sparseguard silence-diff` (channels silent in one map and active in another)."""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from services.cli.common import emit
from services.cli.silence_render import render_html, render_png
from services.config import Settings
from services.shared.engine import load_served_model
from sparse_engine.calibration.pipeline import CalibrationConfig, prepare_data
from sparse_engine.compression.silence import LayerMap, SilenceMap, SilenceRule, diff
from sparse_engine.compression.silence_map import METRICS, build_map, read_critical
from sparse_engine.data import corpora

log = logging.getLogger(__name__)
MAP_FILE = "silence-map"


def register(commands: Any) -> None:
    cmd = commands.add_parser("silence-map", help="map silent channels, confirmed by ablation")
    cmd.add_argument("--model", help="model name, HF directory or GGUF file")
    cmd.add_argument("--data", help="corpus name or text file (default: settings)")
    cmd.add_argument("--samples", type=int, default=100, help="calibration samples")
    cmd.add_argument("--heldout-tokens", type=int, help="held-out tokens for the ablation")
    cmd.add_argument("--out", type=Path, required=True, help="directory for the artefacts")
    cmd.add_argument("--critical", type=Path, help="file of 'LAYER KIND CHANNEL' lines")
    cmd.add_argument("--protect-last", type=int, default=3, help="layers never pruned")
    cmd.add_argument("--metric", choices=METRICS, default="perplexity")
    cmd.add_argument("--max-change-pct", type=float, default=0.5, help="ablation budget")
    cmd.set_defaults(handler=run_map)

    dif = commands.add_parser("silence-diff", help="compare the silent channels of two maps")
    dif.add_argument("a", type=Path)
    dif.add_argument("b", type=Path)
    dif.add_argument("--json", action="store_true", help="print the diff as JSON")
    dif.set_defaults(handler=run_diff)


def run_map(args: argparse.Namespace, settings: Settings) -> int:
    if args.protect_last < 0 or args.samples < 1:
        raise ValueError("--protect-last must be >= 0 and --samples >= 1")
    started = time.perf_counter()
    rule = SilenceRule(protect_last=args.protect_last, max_change_pct=args.max_change_pct)
    critical = read_critical(args.critical) if args.critical else {}
    lm = load_served_model(settings, args.model)
    cfg = CalibrationConfig(
        samples=args.samples,
        seq_len=settings.engine.seq_len,
        heldout_tokens=args.heldout_tokens or settings.engine.heldout_tokens,
    )
    name = args.data or settings.engine.calibration_corpus
    data = prepare_data(lm.tokenizer, corpora.load_texts(name, settings.cache_home), cfg, name)
    total = sum(b.numel() for b in data.batches)
    with tqdm(total=total, unit="tok", desc="capturing activations") as bar:
        smap, series = build_map(lm, data, rule, critical, args.metric, progress=bar.update)
    write_artefacts(smap, series, args.out)
    emit(summary(smap))
    emit(f"wrote {args.out}/{MAP_FILE}.{{json,png,html}} in {time.perf_counter() - started:.1f}s")
    return 0


def write_artefacts(smap: SilenceMap, series: Any, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{MAP_FILE}.json").write_text(json.dumps(smap.to_dict(), separators=(",", ":")))
    (out / f"{MAP_FILE}.png").write_bytes(render_png(smap))
    (out / f"{MAP_FILE}.html").write_text(render_html(smap, series))


def bands(num_layers: int) -> dict[str, range]:
    """Early, middle and late thirds of the layers."""
    a, b = round(num_layers / 3), round(2 * num_layers / 3)
    return {"early": range(0, a), "middle": range(a, b), "late": range(b, num_layers)}


def summary(smap: SilenceMap) -> str:
    lines = [f"silence map of {smap.model_id} on {smap.corpus}: {smap.samples} samples"]
    for band, rows in bands(len(smap.layers)).items():
        picked = [smap.layers[i] for i in rows]
        mlp, attn = _count(picked, "mlp", "silent"), _count(picked, "attn", "silent")
        flagged = _count(picked, "mlp", "flagged") + _count(picked, "attn", "flagged")
        bias = _count(picked, "mlp", "bias_like") + _count(picked, "attn", "bias_like")
        span = f"{rows.start}-{rows.stop - 1}" if rows else "-"
        lines.append(
            f"  {band:6} layers {span:7} silent mlp {mlp:5} attn {attn:5}  "
            f"flagged by rule {flagged:5}  bias-like {bias}"
        )
    ab = smap.ablation
    lines.append(
        f"  ablation ({ab.metric}): {ab.dense:.4f} -> {ab.ablated:.4f} ({ab.change_pct:+.3f}%), "
        f"{'accepted' if ab.accepted else 'rejected'}; protected layers {smap.protected_layers}"
    )
    return "\n".join(lines)


def _count(layers: list[LayerMap], kind: str, verdict: str) -> int:
    return sum(len(getattr(lm.kinds()[kind], verdict)) for lm in layers)


def run_diff(args: argparse.Namespace, settings: Settings) -> int:
    maps = [SilenceMap.from_dict(json.loads(path.read_text())) for path in (args.a, args.b)]
    result = diff(*maps)
    if args.json:
        emit(json.dumps(result, indent=2))
        return 0
    emit(f"a = {args.a} ({result['a']}), b = {args.b} ({result['b']})")
    if not result["layers"]:
        emit("the two maps mark the same channels silent")
    for row in result["layers"]:
        emit(
            f"layer {row['layer']:3} {row['kind']:4}  silent only in a: {_short(row['only_a'])}"
            f"  only in b: {_short(row['only_b'])}"
        )
    return 0


def _short(channels: list[int], limit: int = 12) -> str:
    head = ",".join(str(c) for c in channels[:limit])
    more = f",... ({len(channels)})" if len(channels) > limit else ""
    return f"[{head}{more}]"
