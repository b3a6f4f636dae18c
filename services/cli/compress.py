"""`sparseguard prune`, `compress-eval` and `semi24`: the compression plans of a silence map.
A: runtime masking (no weight change), B: structural pruning, C: 2:4 semi-structured."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from services.cli.bench import measure
from services.cli.common import emit, emit_json
from services.config import Settings
from services.shared.engine import load_served_model
from sparse_engine.compression.prune import intermediate_sizes, prune, pruned_copy, verify
from sparse_engine.compression.semi24 import (
    compliance_table,
    input_norms,
    semi24_copy,
    time_semi_structured,
)
from sparse_engine.data import corpora
from sparse_engine.data.splits import evaluation_tokens, front_documents
from sparse_engine.evaluation.perplexity import PerplexityResult, perplexity
from sparse_engine.model.loader import LoadedModel
from sparse_engine.runtime.engine import Engine
from sparse_engine.sparsity.masking import (
    ChannelMask,
    map_weights_sha256,
    mask_from_map,
    masked,
    parse_layer_list,
    read_bias_like,
    read_silent_channels,
)
from sparse_engine.sparsity.plan import Level, SparsityPlan

log = logging.getLogger(__name__)
VERIFY_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "Once upon a time, in a small village,",
    "The three primary colours are",
    "To make a cup of tea, first",
    "Photosynthesis is the process by which",
    "User: What is 12 times 12?\nAssistant:",
)


def register(commands: Any) -> None:
    p = commands.add_parser("prune", help="plan B: remove silent channels, verify against plan A")
    _map_args(p, required=True)
    p.add_argument("--out", type=Path, required=True, help="directory for the pruned model")
    p.add_argument("--max-new-tokens", type=int, default=16, help="greedy tokens per prompt")
    p.add_argument("--tolerance", type=float, default=1e-3, help="max abs logit difference")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=run_prune)
    e = commands.add_parser("compress-eval", help="perplexity and decode speed: dense, A, B")
    _map_args(e, required=False)
    _data_args(e)
    e.add_argument("--new-tokens", type=int, default=32, help="decode steps for the timing")
    e.add_argument("--repeats", type=int, default=3)
    e.add_argument("--json", action="store_true")
    e.set_defaults(handler=run_compress_eval)
    s = commands.add_parser("semi24", help="plan C: 2:4 compliance and perplexity cost")
    s.add_argument("--model")
    s.add_argument("--roles", default="down,up,gate", help="projections to prune to 2:4")
    s.add_argument("--wanda", action="store_true", help="score |w| * input norm, not |w|")
    _data_args(s)
    s.add_argument("--json", action="store_true")
    s.set_defaults(handler=run_semi24)


def _map_args(parser: Any, required: bool) -> None:
    parser.add_argument("--model", help="model name, HF directory or GGUF file")
    parser.add_argument("--silence-map", type=Path, required=required, help="silence-map JSON")
    parser.add_argument("--silent-layers", help="layers whose whole MLP is removed, e.g. 7,8,9")
    parser.add_argument(
        "--fold-bias-like", action="store_true", help="fold bias-like channels into a bias"
    )


def _data_args(parser: Any) -> None:
    parser.add_argument("--data", default="wiki", help="corpus name or text file")
    parser.add_argument("--tokens", type=int, default=2048, help="held-out tokens to score")


def run_prune(args: argparse.Namespace, settings: Settings) -> int:
    lm = load_served_model(settings, args.model)
    mask, channels, bias_like = _plan(args, lm)
    pruned, result = prune(lm, channels, args.out, bias_like)
    prompts = list(VERIFY_PROMPTS)
    check = verify(pruned, lm, mask, prompts, args.max_new_tokens, args.tolerance)
    report = {
        "out": str(result.out_dir),
        "removed_channels": sum(len(c) for c in channels.values()),
        "folded_channels": sum(len(c) for c in bias_like.values()),
        "params_before": result.params_before,
        "params_after": result.params_after,
        "bytes_on_disk": result.bytes_on_disk,
        "intermediate_sizes": result.intermediate_sizes,
        "verify": {
            "passed": check.passed,
            "tokens_equal": check.tokens_equal,
            "max_abs_logit_diff": check.max_abs_logit_diff,
            "tolerance": check.tolerance,
            "prompts": check.num_prompts,
            "mismatched_prompts": check.mismatched_prompts,
        },
    }
    if args.json:
        emit_json(report)
    else:
        _print_prune(report)
    return 0 if check.passed else 1


def _plan(
    args: argparse.Namespace, lm: LoadedModel
) -> tuple[ChannelMask, dict[int, list[int]], dict[int, list[tuple[int, float]]]]:
    """The plan-A mask and the plan-B channels to remove / fold, from the map and layer list."""
    layers = parse_layer_list(args.silent_layers)
    mask = mask_from_map(args.silence_map, layers, args.fold_bias_like)
    mask.check_fits(lm.layers)
    path = args.silence_map
    if path and map_weights_sha256(path) not in (None, lm.weights_sha256):
        log.warning("%s was measured on other weights than %s", path, lm.model_id)
    channels = read_silent_channels(path) if path else {}
    bias_like = read_bias_like(path) if path and args.fold_bias_like else {}
    sizes = intermediate_sizes(lm.layers)
    for layer in layers:  # a listed layer loses its whole MLP: every channel goes
        channels[layer] = list(range(sizes[layer]))
        bias_like.pop(layer, None)
    return mask, channels, bias_like


def _print_prune(r: dict[str, Any]) -> None:
    v = r["verify"]
    mib = r["bytes_on_disk"] / 2**20
    emit(f"pruned model written to {r['out']} ({mib:.1f} MiB on disk)")
    emit(f"channels removed {r['removed_channels']}, bias-like folded {r['folded_channels']}")
    shrink = 100.0 * (1 - r["params_after"] / r["params_before"])
    emit(f"parameters {r['params_before']:,} -> {r['params_after']:,} (-{shrink:.2f}%)")
    emit(f"intermediate sizes per layer: {r['intermediate_sizes']}")
    status = "PASSED" if v["passed"] else "FAILED"
    emit(
        f"verification against plan A {status}: greedy tokens "
        f"{'equal' if v['tokens_equal'] else 'differ on prompts ' + str(v['mismatched_prompts'])}"
        f" on {v['prompts']} prompts, max |logit diff| {v['max_abs_logit_diff']:.2e} "
        f"(tolerance {v['tolerance']:.0e})"
    )


def run_compress_eval(args: argparse.Namespace, settings: Settings) -> int:
    lm = load_served_model(settings, args.model)
    mask, channels, bias_like = _plan(args, lm)
    if mask.is_empty:
        raise ValueError(
            "nothing to compress: the silence map marks no channel (and no --silent-layers); "
            "pass --silent-layers or a map with confirmed silent channels"
        )
    dense_engine = Engine(lm, {})
    ids = evaluation_tokens(
        lm.tokenizer, corpora.load_texts(args.data, settings.cache_home), args.tokens
    )
    pruned = pruned_copy(lm, channels, bias_like)
    rows = []
    for name in tqdm(("dense", "plan A (masked)", "plan B (pruned)"), desc="perplexity"):
        rows.append({"model": name, "perplexity": _ppl(name, lm, pruned, mask, ids).perplexity})
    dense_ppl = rows[0]["perplexity"]
    for row in rows:
        row["change_pct"] = 100.0 * (row["perplexity"] / dense_ppl - 1.0)
    engines = {"dense": dense_engine, "plan B (pruned)": Engine(pruned, {})}
    for row in rows:
        if row["model"] in engines:
            speed = measure(
                engines[row["model"]], Level.DENSE, args.new_tokens, args.repeats, False
            )
            row["decode_tokens_per_s"] = speed["decode_tokens_per_s"]
    report = {"data": args.data, "tokens": int(ids.numel()), "mask": mask.digest(), "rows": rows}
    report["params"] = {"dense": _params(lm), "pruned": _params(pruned)}
    if args.json:
        emit_json(report)
        return 0
    emit(f"compression on {args.data}: {ids.numel()} held-out tokens, mask {mask.digest()}")
    emit(f"{'model':18}{'perplexity':>12}{'change':>10}{'decode tok/s':>14}")
    for r in rows:
        speed_text = f"{r['decode_tokens_per_s']:>14.1f}" if "decode_tokens_per_s" in r else ""
        emit(f"{r['model']:18}{r['perplexity']:>12.3f}{r['change_pct']:>+9.2f}%{speed_text}")
    emit(f"parameters: dense {report['params']['dense']:,}, pruned {report['params']['pruned']:,}")
    emit(f"decode: batch 1, {torch.get_num_threads()} threads, median of {args.repeats}")
    return 0


def _ppl(
    name: str, lm: LoadedModel, pruned: LoadedModel, mask: ChannelMask, ids: torch.Tensor
) -> PerplexityResult:
    if name.startswith("plan B"):
        return perplexity(pruned.model, pruned.layers, ids, SparsityPlan(), prefix=lm.bos_prefix)
    with masked(lm.layers, mask if name.startswith("plan A") else None):
        return perplexity(lm.model, lm.layers, ids, SparsityPlan(), prefix=lm.bos_prefix)


def _params(lm: LoadedModel) -> int:
    return sum(p.numel() for p in lm.model.parameters())


def run_semi24(args: argparse.Namespace, settings: Settings) -> int:
    roles = tuple(r.strip() for r in args.roles.split(",") if r.strip())
    lm = load_served_model(settings, args.model)
    texts = corpora.load_texts(args.data, settings.cache_home)
    ids = evaluation_tokens(lm.tokenizer, texts, args.tokens)
    before = compliance_table(lm.layers, roles)
    norms = input_norms(lm, _front_batches(lm, texts), roles) if args.wanda else None
    sparse = semi24_copy(lm, roles, norms)
    after = compliance_table(sparse.layers, roles)
    results = [
        perplexity(m.model, m.layers, ids, SparsityPlan(), prefix=m.bos_prefix)
        for m in tqdm((lm, sparse), desc="perplexity")
    ]
    dense_ppl, sparse_ppl = results[0].perplexity, results[1].perplexity
    timing = time_semi_structured(_shapes(lm, roles))
    report = {
        "data": args.data,
        "tokens": int(ids.numel()),
        "roles": list(roles),
        "score": "wanda" if args.wanda else "magnitude",
        "compliance_before": [[c.layer, c.role, round(c.share, 4)] for c in before],
        "compliance_after_min": min(c.share for c in after),
        "perplexity_dense": dense_ppl,
        "perplexity_2_4": sparse_ppl,
        "change_pct": 100.0 * (sparse_ppl / dense_ppl - 1.0),
        "gpu_timing": timing,
    }
    if args.json:
        emit_json(report)
    else:
        _print_semi24(report)
    return 0


def _front_batches(lm: LoadedModel, texts: list[str], count: int = 8) -> list[torch.Tensor]:
    """Calibration-side documents (the front of the shuffled corpus) for Wanda's input norms."""
    encode = lm.tokenizer
    batches = [
        torch.tensor([encode(t, add_special_tokens=False)["input_ids"][:256]])
        for t in front_documents(texts, count)
    ]
    return [b for b in batches if b.numel() > 1]


def _shapes(lm: LoadedModel, roles: tuple[str, ...]) -> list[tuple[int, int]]:
    """The distinct (out, in) weight shapes of the chosen projections, for the GPU timing."""
    shapes = set()
    for role in roles:
        module = lm.layers[0].get(role)
        if isinstance(module, torch.nn.Linear):
            shapes.add((module.out_features, module.in_features))
    return sorted(shapes)


def _print_semi24(r: dict[str, Any]) -> None:
    emit(f"2:4 ({r['score']}) on {', '.join(r['roles'])}; {r['tokens']} tokens of {r['data']}")
    emit(f"{'layer':>6} " + "".join(f"{role:>8}" for role in r["roles"]))
    by_layer: dict[int, list[float]] = {}
    for layer, _, share in r["compliance_before"]:
        by_layer.setdefault(layer, []).append(share)
    for layer, shares in by_layer.items():
        emit(f"{layer:>6} " + "".join(f"{s:>8.3f}" for s in shares))
    compliant = [lay for lay, shares in by_layer.items() if min(shares) >= 1.0]
    emit(f"already 2:4-compliant layers: {compliant or 'none'}")
    emit(f"compliance after masking: {r['compliance_after_min']:.3f} (minimum over projections)")
    emit(
        f"perplexity {r['perplexity_dense']:.3f} -> {r['perplexity_2_4']:.3f} "
        f"({r['change_pct']:+.2f}%)"
    )
    if r["gpu_timing"] is None:
        emit("speed not measured: no GPU")
        return
    for t in r["gpu_timing"]:
        emit(
            f"matmul {t['shape']} x {t['tokens']} tokens: dense {t['dense_ms']:.3f} ms, "
            f"2:4 {t['sparse_ms']:.3f} ms ({t['speedup']:.2f}x)"
        )
