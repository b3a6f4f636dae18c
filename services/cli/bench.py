"""`sparseguard bench quality|engine`: measured figures, printed, never asserted."""

from __future__ import annotations

import argparse
import logging
import resource
import statistics
import time
from typing import Any

import torch

from services.cli import bench_gateway, bench_pipeline, bench_speed
from services.cli.bench_drift import drift_pass_cost
from services.cli.common import emit, emit_json
from services.config import Settings
from services.shared.engine import build_engine
from sparse_engine.data import corpora
from sparse_engine.data.splits import evaluation_tokens
from sparse_engine.evaluation.perplexity import perplexity
from sparse_engine.runtime.engine import Engine, GenerationRequest
from sparse_engine.sparsity.plan import Level
from sparse_engine.trust.features import from_stats
from sparse_engine.trust.model import TrustModel, TrustModelNotFoundError, TrustStore

log = logging.getLogger(__name__)
BENCH_PROMPT = (
    "Write a short explanation of how a city water system works, from the reservoir and the "
    "treatment plant to the pipes under the street and the tap in a kitchen. Mention pressure, "
    "filtration and what happens to waste water afterwards."
)


def register(commands: Any) -> None:
    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(
        dest="action", required=True
    )
    q = bench.add_parser("quality", help="perplexity and sparsity per level on a text")
    q.add_argument("--data", default="wiki", help="corpus name or text file")
    q.add_argument("--tokens", type=int, default=2048, help="tokens to score")
    q.add_argument("--model")
    q.add_argument("--json", action="store_true")
    q.set_defaults(handler=run_quality)
    e = bench.add_parser("engine", help="decode/prefill speed, signal cost, peak memory")
    e.add_argument("--model")
    e.add_argument("--new-tokens", type=int, default=64)
    e.add_argument("--repeats", type=int, default=3)
    e.add_argument("--json", action="store_true")
    e.set_defaults(handler=run_engine)
    bench_gateway.register(bench)
    bench_pipeline.register(bench)
    bench_speed.register(bench)


def run_quality(args: argparse.Namespace, settings: Settings) -> int:
    eng = build_engine(settings, args.model)
    ids = evaluation_tokens(
        eng.lm.tokenizer, corpora.load_texts(args.data, settings.cache_home), args.tokens
    )
    rows = []
    dense = None
    for level in [lv for lv in Level if lv in eng.plans]:
        result = perplexity(
            eng.lm.model, eng.lm.layers, ids, eng.plans[level], prefix=eng.lm.bos_prefix
        )
        dense = dense or result.perplexity
        change = 100.0 * (result.perplexity / dense - 1.0)
        rows.append(
            {
                "level": level.value,
                "sparsity": round(result.sparsity, 4),
                "perplexity": round(result.perplexity, 3),
                "perplexity_change_pct": round(change, 2),
            }
        )
        log.info("%s done", level.value)
    if args.json:
        emit_json({"data": args.data, "tokens": int(ids.numel()), "levels": rows})
        return 0
    emit(f"quality on {args.data}: {ids.numel()} tokens from the middle of the corpus")
    emit(f"{'level':14}{'sparsity':>10}{'perplexity':>12}{'change':>10}")
    for r in rows:
        emit(
            f"{r['level']:14}{r['sparsity']:>10.3f}{r['perplexity']:>12.3f}{r['perplexity_change_pct']:>+9.2f}%"
        )
    return 0


def run_engine(args: argparse.Namespace, settings: Settings) -> int:
    eng = build_engine(settings, args.model)
    rows = [
        measure(eng, level, args.new_tokens, args.repeats, True)
        for level in Level
        if level in eng.plans
    ]
    if Level.BALANCED in eng.plans:
        rows.append(measure(eng, Level.BALANCED, args.new_tokens, args.repeats, False))
    report: dict[str, Any] = {
        "rows": rows,
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "threads": torch.get_num_threads(),
    }
    if Level.BALANCED in eng.plans:
        report["signal_cost_ratio"] = round(
            signal_cost(eng, Level.BALANCED, args.new_tokens, 4 * args.repeats), 3
        )
        model = _trust_model(settings, eng)
        report["trust_model"] = model.version if model else None
        report["trust_cost_ratio"] = round(
            trust_cost(eng, Level.BALANCED, args.new_tokens, 4 * args.repeats, model), 3
        )
    asked = GenerationRequest(
        messages=[{"role": "user", "content": BENCH_PROMPT}],
        max_new_tokens=args.new_tokens,
        ignore_eos=True,
    )
    level = Level.BALANCED if Level.BALANCED in eng.plans else Level.DENSE
    # after the peak RSS is read: the every-position variant's logits are not the engine's
    answer = eng.generate(asked, level).result().token_ids
    report["drift_pass"] = drift_pass_cost(eng, BENCH_PROMPT, answer, args.repeats)
    if args.json:
        emit_json(report)
        return 0
    emit(
        f"engine on {eng.lm.model_id}, batch 1, {report['threads']} threads, "
        f"{args.new_tokens} new tokens, median of {args.repeats}"
    )
    emit(f"{'level':14}{'signals':>8}{'decode tok/s':>14}{'prefill tok/s':>15}{'TTFT ms':>9}")
    for r in rows:
        signals = "on" if r["signals"] else "off"
        emit(
            f"{r['level']:14}{signals:>8}{r['decode_tokens_per_s']:>14.1f}"
            f"{r['prefill_tokens_per_s']:>15.1f}{r['ttft_ms']:>9.1f}"
        )
    if "signal_cost_ratio" in report:
        ratio = report["signal_cost_ratio"]
        emit(
            f"signal cost (balanced decode time, signals on / off, median of "
            f"{4 * args.repeats} back-to-back pairs): {ratio:.3f}x"
        )
        emit(
            f"trust cost (balanced request latency, readout and trust score on / off, median of "
            f"{4 * args.repeats} back-to-back pairs; trust model "
            f"{report['trust_model'] or 'none: readout only'}): {report['trust_cost_ratio']:.3f}x"
        )
    d = report["drift_pass"]
    for n in (16, 1):
        mib = d[f"batch_{n}_logits_mib"]
        emit(
            f"KL-drift pass, {n} answer(s) of {d['answer_tokens']} tokens: head on the "
            f"answer spans {d[f'batch_{n}_span_ms']:.0f} ms ({mib['span']} MiB of "
            f"logits), at every position {d[f'batch_{n}_every_position_ms']:.0f} ms "
            f"({mib['every_position']} MiB)"
        )
    emit(f"peak RSS: {report['peak_rss_mib']} MiB")
    return 0


def signal_cost(eng: Engine, level: Level, new_tokens: int, pairs: int) -> float:
    """Decode time with the per-request signals over decode time without: the median ratio of
    back-to-back pairs, so that the machine's drift over the run cancels."""
    ratios: list[float] = []
    for _ in range(pairs):
        on, off = (
            measure(eng, level, new_tokens, 1, signals, warm_up=False)["decode_tokens_per_s"]
            for signals in (True, False)
        )
        ratios.append(float(off) / float(on))
    return statistics.median(ratios)


def trust_cost(
    eng: Engine, level: Level, new_tokens: int, pairs: int, model: TrustModel | None
) -> float:
    """A request's latency (prefill, decode and, when on, the readout and the trust model's
    score) with the trust features over without: median ratio of back-to-back pairs."""
    messages = [{"role": "user", "content": BENCH_PROMPT}]

    def latency(readout: bool) -> float:
        request = GenerationRequest(
            messages=messages, max_new_tokens=new_tokens, ignore_eos=True, readout=readout
        )
        started = time.perf_counter()
        stats = eng.generate(request, level).result()
        if readout and model is not None:
            model.score(from_stats(stats, BENCH_PROMPT))
        return time.perf_counter() - started

    latency(True)  # warm-up
    return statistics.median(latency(True) / latency(False) for _ in range(pairs))


def _trust_model(settings: Settings, eng: Engine) -> TrustModel | None:
    try:
        return TrustStore(settings.trust_dir).latest(eng.lm.model_id, Level.BALANCED.value)
    except TrustModelNotFoundError:
        return None


def measure(
    eng: Engine, level: Level, new_tokens: int, repeats: int, signals: bool, warm_up: bool = True
) -> dict[str, Any]:
    messages = [{"role": "user", "content": BENCH_PROMPT}]
    # Every level decodes the same number of steps: the end-of-sequence token is ignored.
    request = GenerationRequest(
        messages=messages, max_new_tokens=new_tokens, collect_signals=signals, ignore_eos=True
    )
    if warm_up:
        eng.generate(request, level).result()
    runs = [eng.generate(request, level).result() for _ in range(repeats)]
    log.debug(
        "%s (signals %s): %s tokens", level.value, signals, [r.completion_tokens for r in runs]
    )
    return {
        "level": level.value,
        "signals": signals,
        "decode_tokens_per_s": round(statistics.median(r.decode_tokens_per_s for r in runs), 2),
        "prefill_tokens_per_s": round(statistics.median(r.prefill_tokens_per_s for r in runs), 1),
        "ttft_ms": round(1000 * statistics.median(r.time_to_first_token_s for r in runs), 1),
        "completion_tokens": runs[-1].completion_tokens,
    }
