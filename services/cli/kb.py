"""`sparseguard kb ingest|search`: the knowledge base that fallback retrieval searches."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session
from tqdm import tqdm

from services.cli.common import emit, emit_json
from services.config import Settings
from services.storage import kb as knowledge
from services.storage.db import make_engine, masked_url, session_factory, upgrade
from sparse_engine.data.corpora import load_texts

log = logging.getLogger(__name__)

BATCH_SIZE = 500  # passages per transaction: progress survives an interrupted ingest
TITLE_CHARS = 120
SNIPPET_CHARS = 200
EMPTY = "the knowledge base is empty; add passages with `sparseguard kb ingest SPEC`"


def register(commands: Any) -> None:
    kb = commands.add_parser("kb", help="the knowledge base for fallback retrieval")
    actions = kb.add_subparsers(dest="action", required=True)
    ingest = actions.add_parser("ingest", help="chunk documents into the knowledge base")
    ingest.add_argument(
        "specs", nargs="+", metavar="SPEC", help="corpus name (e.g. halueval-knowledge) or file"
    )
    ingest.add_argument("--source", help="source label of every passage (default: its SPEC)")
    ingest.add_argument(
        "--chunk-chars", type=positive, default=800, help="most characters per passage"
    )
    ingest.set_defaults(handler=ingest_passages)
    search = actions.add_parser("search", help="the passages a question retrieves")
    search.add_argument("query", metavar="QUERY")
    search.add_argument("--k", type=positive, default=3, help="how many hits to show")
    search.add_argument("--json", action="store_true", help="print the hits as JSON")
    search.set_defaults(handler=search_passages)


def positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number


def ingest_passages(args: argparse.Namespace, settings: Settings) -> int:
    # Every spec is read before the database is touched: a bad one fails with nothing written.
    documents = {spec: load_texts(spec, settings.cache_home) for spec in args.specs}
    passages = [
        passage
        for spec, texts in documents.items()
        for passage in document_passages(texts, args.source or spec, args.chunk_chars)
    ]
    with open_session(settings) as session:
        result = ingest_batches(session, passages)
        total = knowledge.count(session)
    emit(
        f"ingested {result.added} new passages ({result.present} already present) from "
        f"{', '.join(documents)}; the knowledge base holds {total} passages"
    )
    return 0


def search_passages(args: argparse.Namespace, settings: Settings) -> int:
    with open_session(settings) as session:
        hits = knowledge.search(session, args.query, args.k)
        is_empty = not hits and knowledge.count(session) == 0
    if args.json:
        if is_empty:
            log.warning(EMPTY)
        emit_json([asdict(hit) for hit in hits])
    elif is_empty:
        emit(EMPTY)
    elif not hits:
        emit(f"no passage matches {args.query!r}")
    else:
        show(hits)
    return 0


def document_passages(
    documents: Iterable[str], source: str, max_chars: int
) -> Iterator[knowledge.Passage]:
    for document in documents:
        title = document_title(document)
        for text in knowledge.chunk(document, max_chars):
            yield knowledge.Passage(source=source, title=title, text=text)


def document_title(document: str) -> str:
    """The first line of a document of several lines, else ''."""
    first, _, rest = document.strip().partition("\n")
    return first.strip()[:TITLE_CHARS] if rest.strip() else ""


def ingest_batches(session: Session, passages: list[knowledge.Passage]) -> knowledge.IngestResult:
    added = present = 0
    with tqdm(total=len(passages), unit="passage", desc="ingesting") as bar:
        for start in range(0, len(passages), BATCH_SIZE):
            batch = passages[start : start + BATCH_SIZE]
            result = knowledge.ingest(session, batch)
            session.commit()
            added, present = added + result.added, present + result.present
            bar.update(len(batch))
    return knowledge.IngestResult(added=added, present=present)


def show(hits: list[knowledge.Hit]) -> None:
    for number, hit in enumerate(hits, start=1):
        emit(f"{number}. rank {hit.rank:.4g}  [{hit.source}]  {hit.title}")
        snippet = hit.text[:SNIPPET_CHARS]
        emit(f"   {snippet}{'...' if len(hit.text) > SNIPPET_CHARS else ''}")


@contextmanager
def open_session(settings: Settings) -> Iterator[Session]:
    """A session on the configured database, migrated to the newest schema first."""
    url = settings.database_url
    try:
        upgrade(url)
        engine = make_engine(url)
        try:
            with session_factory(engine)() as session:
                yield session
        finally:
            engine.dispose()
    except OperationalError as exc:
        raise OSError(f"cannot use the database {masked_url(url)}: {exc.orig}") from exc
