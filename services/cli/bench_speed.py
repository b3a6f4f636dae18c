"""`sparseguard bench speed`: decode tokens/s at batch 1, side by side: the Hugging Face
reference (dense), the fast path (dense and each calibrated level) and llama.cpp on the same
GGUF when llama-cpp-python is installed; with weight bytes per token and the share of the
measured bandwidth ceiling each reaches."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import torch
from tqdm import tqdm

from services.cli.bench_packing import packing_rounds, print_packing
from services.cli.common import emit, emit_json
from services.config import Settings
from services.shared.engine import build_engine
from sparse_engine.bench.batch_step import batch_step_speed, burst_speed, prefill_speed
from sparse_engine.bench.speed import (
    GB,
    SpeedRow,
    fast_perplexity,
    fast_speed,
    goals,
    llama_cpp_speed,
    reference_bytes,
    reference_speed,
    stream_bandwidth,
)
from sparse_engine.data import corpora, traffic
from sparse_engine.data.splits import evaluation_tokens
from sparse_engine.model.catalog import gguf_file
from sparse_engine.model.known import KNOWN
from sparse_engine.runtime import kernels
from sparse_engine.runtime.fast_weights import DTYPES, unsupported_reason
from sparse_engine.runtime.fastpath import FastDecoder
from sparse_engine.sparsity.plan import SPARSE_LEVELS, Level

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def register(bench: Any) -> None:
    s = bench.add_parser("speed", help="decode tok/s: reference, fast path, llama.cpp")
    s.add_argument("--model")
    s.add_argument("--new-tokens", type=int, default=64)
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument(
        "--quality-tokens", type=int, default=256,
        help="held-out wiki tokens each fast-path row is teacher-forced over (0: skip)",
    )  # fmt: skip
    s.add_argument(
        "--dtypes", default=",".join(DTYPES), help="fast-path weight types, comma-separated"
    )
    s.add_argument("--json", action="store_true")
    s.set_defaults(handler=run_speed)
    b = bench.add_parser("batch-step", help="a decode step of B sequences: batched vs row by row")
    b.add_argument("--model")
    b.add_argument("--level", default="balanced")
    b.add_argument("--sizes", default="1,2,4,8,16,32", help="batch sizes, comma-separated")
    b.add_argument(
        "--prefill-lengths",
        default="16,64,128,256,512",
        help="prompt lengths (tokens) whose prefill is timed alone, comma-separated",
    )
    b.add_argument(
        "--load-clients", type=int, default=16,
        help="concurrent clients of the scheduler load, prefills packed vs one by one (0: skip)",
    )  # fmt: skip
    b.add_argument("--load-rounds", type=int, default=3, help="load rounds of each way")
    b.add_argument("--json", action="store_true")
    b.set_defaults(handler=run_batch_step)


def run_batch_step(args: argparse.Namespace, settings: Settings) -> int:
    """Per batch size, ms per decode step each way, on real prompts (ShareGPT) in the slots."""
    level = Level.parse(args.level)
    sizes = sorted({int(n) for n in args.sizes.split(",") if n.strip()})
    lengths = sorted({int(n) for n in args.prefill_lengths.split(",") if n.strip()})
    if not sizes or min(sizes) < 1 or not lengths or min(lengths) < 1:
        raise ValueError("--sizes and --prefill-lengths take positive integers, comma-separated")
    if args.load_clients < 0 or args.load_rounds < 1:
        raise ValueError("--load-clients must be 0 or more and --load-rounds at least 1")
    engine = build_engine(settings, args.model)
    chats = traffic.healthy(
        "chat", settings.cache_home, "evaluation", max(*sizes, 2 * args.load_clients)
    )
    prompts = [engine.encode_messages(p.messages()) for p in chats[: max(sizes)]]
    plan = engine.plan(level)
    rows = batch_step_speed(engine, plan, prompts, sizes)
    joined = [t for ids in prompts for t in ids]
    prefills = prefill_speed(engine, plan, joined, lengths)
    burst = burst_speed(engine, plan, prompts)
    tokens = sorted(len(ids) for ids in prompts)
    load = None
    if args.load_clients:
        messages = [p.messages() for p in chats]
        load = packing_rounds(
            engine, level, messages, args.load_clients, args.load_rounds,
            batch_from=settings.engine.batch_from,
        )  # fmt: skip
    if args.json:
        emit_json(
            {
                "level": level.value,
                "rows": [dataclasses.asdict(r) for r in rows],
                "prefill": [dataclasses.asdict(r) for r in prefills],
                "burst": {**dataclasses.asdict(burst), "prompt_tokens": tokens},
                "load": load,
            }
        )
        return 0
    emit(f"decode step of B sequences at {level.value} ({engine.lm.model_id}), ms per step")
    emit(f"{'B':>3} {'row by row':>11} {'batched':>8} {'mixed':>7} {'union read':>11}  faster")
    for r in rows:
        emit(
            f"{r.batch:>3} {r.row_by_row_ms:>11.1f} {r.batched_ms:>8.1f} {r.mixed_ms:>7.1f} "
            f"{r.union_read_share:>11.2f}  {r.best}"
        )
    emit("mixed: half the rows dense, half at the level, in one batch (per-row thresholds)")
    emit(f"prefill of one prompt alone at {level.value}")
    emit(f"{'tokens':>6} {'ms':>8} {'ms/token':>9}")
    for p in prefills:
        emit(f"{p.tokens:>6} {p.ms:>8.1f} {p.ms_per_token:>9.2f}")
    emit(
        f"burst: the {len(prompts)} prompts above ({burst.tokens} tokens, median "
        f"{tokens[len(tokens) // 2]}, largest {tokens[-1]}) arriving together, prefilled before "
        f"the last of them gets its first token: one after another {burst.one_by_one_ms:.0f} ms, "
        f"in one packed pass {burst.packed_ms:.0f} ms (medians of 3, alternated)"
    )
    if load is not None:
        print_packing(load)
    return 0


def run_speed(args: argparse.Namespace, settings: Settings) -> int:
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if args.new_tokens < 2 or args.repeats < 1:
        raise ValueError("--new-tokens must be at least 2 and --repeats at least 1")
    if args.quality_tokens and args.quality_tokens < 16:
        raise ValueError("--quality-tokens must be 0 (skip) or at least 16")
    if not dtypes or set(dtypes) - set(DTYPES):
        raise ValueError(f"--dtypes takes a comma-separated subset of {', '.join(DTYPES)}")
    eng = build_engine(settings, args.model, fast=False)
    native = kernels.load()
    messages = [{"role": "user", "content": PROMPT}]
    ids = eng.encode_messages(messages)
    texts = corpora.load_texts("wiki", settings.cache_home) if args.quality_tokens else []
    held_out = (
        evaluation_tokens(eng.lm.tokenizer, texts, args.quality_tokens).tolist() if texts else []
    )
    max_len = max(len(ids) + args.new_tokens, len(held_out) + len(eng.lm.bos_prefix)) + 1
    levels = [Level.DENSE, *(lv for lv in SPARSE_LEVELS if lv in eng.plans)]
    rows: list[SpeedRow] = []
    notes: list[str] = []
    name = args.model or settings.engine.model
    fast_ok = unsupported_reason(eng.lm)
    if fast_ok is not None:
        notes.append(f"fast path: {fast_ok}")
        dtypes = []
    runs = 3 + len(dtypes) * len(levels) + (native is not None and fast_ok is None)
    with tqdm(total=runs, unit="run", desc="benchmarking decode") as bar:
        bandwidth = stream_bandwidth(native)
        bar.update()
        tps = reference_speed(eng, messages, Level.DENSE, args.new_tokens, args.repeats)
        rows.append(SpeedRow("reference", "dense", tps, reference_bytes(eng.lm.model), bandwidth))
        bar.update()
        if native is not None and fast_ok is None:  # the PyTorch fallback, for comparison
            decoder = FastDecoder(eng.lm, max_len)
            tps, share = fast_speed(decoder, ids, eng, Level.DENSE, args.new_tokens, args.repeats)
            rows.append(SpeedRow("pytorch", "dense", tps, decoder.weight_bytes(share), bandwidth))
            bar.update()
        path = "fast" if native is not None else "pytorch"
        for dtype in dtypes:
            decoder = FastDecoder(eng.lm, max_len, dtype, native)
            for level in levels:
                tps, share = fast_speed(decoder, ids, eng, level, args.new_tokens, args.repeats)
                bytes_read = decoder.weight_bytes(share)
                ppl = (
                    fast_perplexity(decoder, held_out, eng.plan(level), eng.lm.bos_prefix)
                    if held_out
                    else None
                )
                rows.append(SpeedRow(path, level.value, tps, bytes_read, bandwidth, dtype, ppl))
                bar.update()
            del decoder
        if name in KNOWN:
            gguf = gguf_file(name, settings.cache_home)
            cpp = llama_cpp_speed(str(gguf), PROMPT, args.new_tokens, torch.get_num_threads())
            if isinstance(cpp, float):
                size, quant = gguf.stat().st_size, KNOWN[name].quant
                rows.append(SpeedRow("llama.cpp", "dense", cpp, size, bandwidth, quant))
            else:
                notes.append(f"llama.cpp: {cpp}")
        else:
            notes.append("llama.cpp: compared only on a known model's GGUF")
        bar.update()
    _report(rows, args.json, bandwidth, "; ".join(notes))
    return 0


def _report(rows: list[SpeedRow], as_json: bool, bandwidth: float, notes: str) -> None:
    if as_json:
        emit_json(
            {
                "bandwidth_gb_per_s": bandwidth / GB,
                "rows": [
                    {
                        **dataclasses.asdict(r),
                        "ceiling_tokens_per_s": r.ceiling_tokens_per_s,
                        "ceiling_share": r.ceiling_share,
                    }
                    for r in rows
                ],
                "notes": notes or None,
                "goals": [{"goal": text, "met": met} for text, met in goals(rows)],
            }
        )
        return
    emit(f"matrix-vector bandwidth here: {bandwidth / GB:.1f} GB/s (float32, batch 1)")
    head = f"{'path':<10}{'weights':<9}{'level':<14}{'tok/s':>8}{'MB/token':>10}{'ceiling':>9}"
    emit(f"{head}{'share':>7}{'ppl':>8}")
    for r in rows:
        ppl = f"{r.perplexity:>8.2f}" if r.perplexity is not None else f"{'':>8}"
        emit(
            f"{r.path:<10}{r.weights:<9}{r.level:<14}{r.tokens_per_s:>8.1f}"
            f"{r.bytes_per_token / 1e6:>10.1f}{r.ceiling_tokens_per_s:>9.1f}"
            f"{100 * r.ceiling_share:>6.0f}%{ppl}"
        )
    emit("ppl: perplexity teacher-forced through the fast path on held-out wiki text")
    if notes:
        emit(notes)
    for text, met in goals(rows):
        emit(f"{'met' if met else 'NOT met':>8}  {text}")
