"""`sparseguard golden create|show`: golden sets of prompts with reference answers."""

from __future__ import annotations

import argparse
import logging
from collections import Counter
from pathlib import Path
from typing import Any

from tqdm import tqdm

from services.cli.common import emit
from services.config import Settings
from services.shared.engine import build_engine
from services.workers.golden import freeze
from services.workers.golden_set import load_golden, read_prompts, write_golden

log = logging.getLogger(__name__)


def register(commands: Any) -> None:
    golden = commands.add_parser("golden", help="golden sets for the drift check").add_subparsers(
        dest="action", required=True
    )
    create = golden.add_parser("create", help="freeze the dense model's answers as references")
    create.add_argument("--prompts", type=Path, required=True, help=".jsonl or text, one a line")
    create.add_argument("--out", type=Path, required=True, help="golden-set JSONL to write")
    create.add_argument("--max-new-tokens", type=int, help="answer length (default: settings)")
    create.add_argument("--model", help="model name, HF directory or GGUF file")
    create.add_argument("--force", action="store_true", help="replace an existing --out file")
    create.set_defaults(handler=create_golden)
    show = golden.add_parser("show", help="count a golden set's items by reference source")
    show.add_argument("--file", type=Path, help="golden-set JSONL (default: settings)")
    show.set_defaults(handler=show_golden)


def create_golden(args: argparse.Namespace, settings: Settings) -> int:
    if args.out.exists() and not args.force:
        raise ValueError(f"{args.out} exists; pass --force to replace its references")
    max_new_tokens = args.max_new_tokens or settings.jobs.golden_max_new_tokens
    prompts = read_prompts(args.prompts)  # before the model loads: fail fast on a bad file
    engine = build_engine(settings, args.model)  # the served decode path; dense answers only
    with tqdm(total=len(prompts), unit="prompt", desc="freezing dense answers") as bar:
        items = freeze(engine, prompts, max_new_tokens, progress=bar.update)
    write_golden(args.out, items)
    emit(f"wrote {len(items)} references from {engine.lm.model_id} to {args.out}")
    return 0


def show_golden(args: argparse.Namespace, settings: Settings) -> int:
    path: Path = args.file or settings.golden_set_path
    if not path.is_file():
        raise FileNotFoundError(
            f"no golden set at {path}; the first golden check builds the default from "
            "MT-Bench, or run `sparseguard golden create --prompts FILE --out FILE`"
        )
    items = load_golden(path)
    emit(f"{len(items)} items in {path}")
    for source, count in Counter(item.source for item in items).most_common():
        emit(f"  {count:5d}  {source}")
    return 0
