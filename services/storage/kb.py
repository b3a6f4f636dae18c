"""The knowledge base for fallback retrieval: passages in `kb_passages`, searched by full text.

`ingest(session, passages)` stores passages once each (deduplicated by the sha256 of their
whitespace-normalised text), `search(session, query, k)` returns the best `k` hits for a
question (FTS5 with bm25 on SQLite, a tsvector with ts_rank_cd on PostgreSQL; higher rank is
better on both), `count(session)` the passages stored, and `chunk(text, max_chars)` splits a
document into passages. Like the repository, nothing here commits: the caller does.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from sqlalchemy import TextClause, func, select, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from services.storage.models import KBPassage

MAX_TERMS = 32
FTS_TABLE = "kb_fts"
SEARCH_COLUMN = "search"
SEARCH_INDEX = "ix_kb_passages_search"
# Words that carry no topic: dropped from queries so that "what is the capital of France"
# searches for capital and France, not for every passage containing "the".
_STOP_WORD_LIST = (
    "a about above after again all also am an and any are as at be because been before being "
    "both but by can could did do does doing down during each few for from further had has "
    "have having he her here hers him his how if in into is it its itself just me more most my "
    "no nor not now of off on once only or other our ours out over own same she should so some "
    "such than that the their theirs them then there these they this those through to too "
    "under until up very was we were what when where which while who whom whose why will with "
    "would you your yours"
)
STOP_WORDS = frozenset(_STOP_WORD_LIST.split())

_WORD = re.compile(r"\w+")
_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")

_SQLITE_SEARCH = text(
    "SELECT p.id, p.source, p.title, p.text, -bm25(kb_fts) AS score "
    "FROM kb_fts JOIN kb_passages AS p ON p.id = kb_fts.rowid "
    "WHERE kb_fts MATCH :query ORDER BY bm25(kb_fts), p.id LIMIT :k"
)
# Normalisation 1 divides by 1 + log(length), as bm25 favours the shorter of two passages
# matching as many terms: PostgreSQL has no term rarity, so plain ts_rank_cd ties them.
_POSTGRES_SEARCH = text(
    "SELECT p.id, p.source, p.title, p.text, ts_rank_cd(p.search, q, 1) AS score "
    "FROM kb_passages AS p, to_tsquery('english', :query) AS q "
    "WHERE p.search @@ q ORDER BY score DESC, p.id LIMIT :k"
)


@dataclass(frozen=True, slots=True)
class Passage:
    source: str
    title: str
    text: str


@dataclass(frozen=True, slots=True)
class Hit:
    id: int
    source: str
    title: str
    text: str
    rank: float  # higher is better, on both backends


@dataclass(frozen=True, slots=True)
class IngestResult:
    added: int
    present: int  # skipped: the same text is stored already, or came earlier in this call


def _fts5_query(terms: list[str]) -> str:
    # Quoted, each term is a plain string to FTS5: no operator, column filter or NEAR.
    return " OR ".join(f'"{term}"' for term in terms)


def _tsquery(terms: list[str]) -> str:
    # Terms are \w+ only, which holds none of tsquery's operators or quotes.
    return " | ".join(terms)


_BACKENDS: Mapping[str, tuple[TextClause, Callable[[list[str]], str]]] = {
    "sqlite": (_SQLITE_SEARCH, _fts5_query),
    "postgresql": (_POSTGRES_SEARCH, _tsquery),
}


def squash_whitespace(value: str) -> str:
    """The text with every run of whitespace made one space, and none at the ends."""
    return " ".join(value.split())


def digest(passage_text: str) -> str:
    return hashlib.sha256(squash_whitespace(passage_text).encode("utf-8")).hexdigest()


def query_terms(query: str) -> list[str]:
    """The distinct search terms of a question, lower-cased, stop words and single characters
    dropped, in order of first appearance, at most MAX_TERMS."""
    words = (word.lower() for word in _WORD.findall(query))
    kept = (word for word in words if len(word) > 1 and word not in STOP_WORDS)
    return list(dict.fromkeys(kept))[:MAX_TERMS]


def ingest(session: Session, passages: Iterable[Passage]) -> IngestResult:
    """Store the passages whose text is not stored yet. Raises ValueError for a passage with
    no text, before anything is written."""
    given = 0
    rows: dict[str, dict[str, str]] = {}
    for passage in passages:
        given += 1
        row = _row(passage, given)
        rows.setdefault(row["digest"], row)
    if not rows:
        return IngestResult(added=0, present=given)
    statement = (
        _insert(session)
        .on_conflict_do_nothing(index_elements=["digest"])
        .returning(KBPassage.digest)
    )
    added = len(session.scalars(statement, list(rows.values())).all())
    return IngestResult(added=added, present=given - added)


def search(session: Session, query: str, k: int) -> list[Hit]:
    """The best `k` passages for `query`, best first; [] when the query has no search terms."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    statement, render = _backend(session)
    terms = query_terms(query)
    if not terms:
        return []
    rows = session.execute(statement, {"query": render(terms), "k": k})
    return [Hit(row.id, row.source, row.title, row.text, float(row.score)) for row in rows]


def count(session: Session) -> int:
    return session.scalar(select(func.count()).select_from(KBPassage)) or 0


def chunk(text: str, max_chars: int) -> list[str]:
    """Passages of at most `max_chars` characters: paragraphs (split at blank lines) and, for
    those too long, their sentences, packed greedily; a sentence longer than `max_chars` is
    cut at a space where it can be. Whitespace is normalised and empty passages dropped."""
    if max_chars < 1:
        raise ValueError(f"max_chars must be at least 1, got {max_chars}")
    chunks: list[str] = []
    current = ""
    for piece in _pieces(text, max_chars):
        if current and len(current) + 1 + len(piece) <= max_chars:
            current = f"{current} {piece}"
            continue
        if current:
            chunks.append(current)
        current = piece
    if current:
        chunks.append(current)
    return chunks


def include_name(name: str | None, type_: str, parent_names: Mapping[str, str | None]) -> bool:
    """For Alembic's `include_name`: False for the full-text objects the migration keeps beside
    kb_passages (FTS5 tables, the tsvector column and its index), which no model maps, so that
    schema comparisons and autogenerate leave them alone."""
    if type_ == "table":
        return name != FTS_TABLE and not (name or "").startswith(f"{FTS_TABLE}_")
    if parent_names.get("table_name") != KBPassage.__tablename__:
        return True
    return (type_, name) not in {("column", SEARCH_COLUMN), ("index", SEARCH_INDEX)}


def _row(passage: Passage, number: int) -> dict[str, str]:
    body = squash_whitespace(passage.text)
    if not body:
        raise ValueError(f"passage {number} ({passage.source!r}) has no text; drop it first")
    return {
        "source": passage.source,
        "title": squash_whitespace(passage.title),
        "text": body,
        "digest": digest(body),
    }


def _insert(session: Session) -> postgresql.Insert | sqlite.Insert:
    """The dialect's INSERT, which has ON CONFLICT (the generic one does not)."""
    if _dialect(session) == "postgresql":
        return postgresql.insert(KBPassage)
    return sqlite.insert(KBPassage)


def _backend(session: Session) -> tuple[TextClause, Callable[[list[str]], str]]:
    return _BACKENDS[_dialect(session)]


def _dialect(session: Session) -> str:
    name = session.get_bind().dialect.name
    if name not in _BACKENDS:
        raise ValueError(
            f"the knowledge base needs SQLite or PostgreSQL ({', '.join(_BACKENDS)}), not {name!r}"
        )
    return name


def _pieces(text: str, max_chars: int) -> Iterator[str]:
    for paragraph in _PARAGRAPH_BREAK.split(text):
        flat = squash_whitespace(paragraph)
        if len(flat) <= max_chars:
            if flat:
                yield flat
            continue
        for sentence in _SENTENCE_END.split(flat):
            yield from _cut(sentence, max_chars)


def _cut(sentence: str, max_chars: int) -> Iterator[str]:
    while len(sentence) > max_chars:
        at = sentence.rfind(" ", 0, max_chars + 1)
        at = at if at > 0 else max_chars  # one word longer than max_chars: cut inside it
        yield sentence[:at].rstrip()
        sentence = sentence[at:].lstrip()
    if sentence:
        yield sentence
