"""`sparseguard eval temperature`: what raising temperature 0 to 0.3 on a sparse level does.
The raise was a rule copied with the levels (a sparse model at greedy decoding was said to fall
into loops); the gateway keeps greedy unless `SPARSEGUARD_GATEWAY__RAISE_ZERO_TEMPERATURE`
turns it on. This measures both sides on a QA set's eval half, at each level asked for: the
share of answers right, the share that loop (a 3-token sequence four times or more) and the
share that run to the token limit, at temperature 0 and at 0.3 (seeded per item)."""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

from tqdm import tqdm

from services.cli.common import emit, emit_json, eval_commands
from services.config import Settings
from services.shared.engine import build_engine
from sparse_engine.data.qa_sets import QA_SETS
from sparse_engine.runtime.generation import GenerationRequest
from sparse_engine.sparsity.plan import Level
from sparse_engine.trust.qa import grade, load_qa, qa_messages, qa_sample

TEMPERATURES = (0.0, 0.3)
LOOP_NGRAM, LOOP_REPEATS = 3, 4


def register(commands: Any) -> None:
    cmd = eval_commands(commands).add_parser(
        "temperature", help="greedy against temperature 0.3 on sparse levels: accuracy, loops"
    )
    cmd.add_argument("--data", default="coqa", choices=list(QA_SETS))
    cmd.add_argument("--n", type=int, default=60, help="items (about; from the eval half)")
    cmd.add_argument("--levels", default="dense,balanced", help="comma-separated levels")
    cmd.add_argument("--max-new-tokens", type=int, default=64)
    cmd.add_argument("--model", help="model name, HF directory or GGUF file")
    cmd.add_argument("--json", action="store_true", help="print the figures as JSON")
    cmd.set_defaults(handler=run_temperature)


def looped(tokens: list[int]) -> bool:
    grams = Counter(tuple(tokens[i : i + LOOP_NGRAM]) for i in range(len(tokens) - 2))
    return bool(grams) and max(grams.values()) >= LOOP_REPEATS


def run_temperature(args: argparse.Namespace, settings: Settings) -> int:
    if args.n < 1:
        raise ValueError("--n must be at least 1")
    levels = [Level.parse(name) for name in args.levels.split(",")]
    items = load_qa(args.data, settings.cache_home)
    indices = qa_sample(items, "eval", args.n)
    eng = build_engine(settings, args.model)
    rows = []
    with tqdm(total=len(levels) * len(TEMPERATURES) * len(indices), desc="answers") as bar:
        for level in levels:
            for temperature in TEMPERATURES:
                right = loops = capped = 0
                for index in indices:
                    item = items[index]
                    request = GenerationRequest(
                        messages=qa_messages(item),
                        max_new_tokens=args.max_new_tokens,
                        temperature=temperature,
                        seed=index,
                    )
                    generation = eng.generate(request, level)
                    text = "".join(generation)
                    stats = generation.result()
                    right += grade(text, item.answers).correct
                    loops += looped(stats.token_ids)
                    capped += stats.finish_reason == "length"
                    bar.update()
                n = len(indices)
                rows.append(
                    {
                        "level": level.value,
                        "temperature": temperature,
                        "items": n,
                        "accuracy": right / n,
                        "looped": loops / n,
                        "hit_max_tokens": capped / n,
                    }
                )
    if args.json:
        emit_json({"data": args.data, "split": "eval", "rows": rows})
        return 0
    emit(f"{args.data}, eval half, {len(indices)} items, max {args.max_new_tokens} new tokens")
    emit(f"{'level':<13}{'temp':>6}{'right':>8}{'looped':>8}{'at limit':>10}")
    for r in rows:
        emit(
            f"{r['level']:<13}{r['temperature']:>6.1f}{r['accuracy']:>8.3f}"
            f"{r['looped']:>8.3f}{r['hit_max_tokens']:>10.3f}"
        )
    return 0
