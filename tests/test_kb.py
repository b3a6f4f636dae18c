"""The knowledge base for fallback retrieval, on a migrated SQLite file and a temporary
PostgreSQL database (skipped only when PostgreSQL is unreachable): ingest dedupes, search ranks
the answering passage first with stemming and survives hostile queries, the full-text index
follows updates and deletes, the migration downgrades cleanly, and `sparseguard kb` works end
to end. Chunking, query terms and the HaluEval knowledge parser are tested without a database."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
from alembic import command
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, create_mock_engine, inspect, text
from sqlalchemy.orm import Session, sessionmaker

from services.cli import main
from services.storage import kb
from services.storage.db import alembic_config, make_engine, session_factory, upgrade
from sparse_engine.data.corpora import CORPORA, HALUEVAL_QA, parse_halueval_knowledge
from tests.status_fixtures import migrated_database

PASSAGES = [
    kb.Passage("geo", "Paris", "Paris is the capital and largest city of France."),
    kb.Passage("space", "Jupiter", "Jupiter is the largest planet in the Solar System."),
    kb.Passage("code", "Python", "Python is a programming language created by Guido van Rossum."),
    kb.Passage("sport", "", "She runs five kilometres along the river every morning."),
    kb.Passage("geo", "Berlin", "Berlin is the capital of Germany."),
]
HOSTILE = ['" OR 1=1; --', "NEAR(a b)", "title:paris", "a*", "'); DROP TABLE kb_passages; --"]
HOSTILE += ["the of and is", "?!... ---", "", "AND OR NOT", "x² ½ ﬁ __ _", "paris & !france"]


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    with migrated_database(request.param, tmp_path) as migrated:
        yield migrated


@pytest.fixture
def sessions(url: str) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(url)
    yield session_factory(engine)
    engine.dispose()


@pytest.fixture
def filled(sessions: sessionmaker[Session]) -> sessionmaker[Session]:
    with sessions.begin() as session:
        kb.ingest(session, PASSAGES)
    return sessions


def test_ingest_counts_new_and_present_and_is_idempotent(sessions: sessionmaker[Session]) -> None:
    respaced = kb.Passage("other", "T", "  Paris is the capital and\nlargest city of  France. ")
    with sessions.begin() as session:
        assert kb.ingest(session, [*PASSAGES, respaced]) == kb.IngestResult(added=5, present=1)
    with sessions.begin() as session:
        assert kb.ingest(session, PASSAGES) == kb.IngestResult(added=0, present=5)
        assert kb.ingest(session, []) == kb.IngestResult(added=0, present=0)
        assert kb.count(session) == 5
    with sessions() as session, pytest.raises(ValueError, match="has no text"):
        kb.ingest(session, [kb.Passage("s", "t", " \n ")])


@pytest.mark.parametrize(
    ("question", "title"),
    [
        ("What is the capital of France?", "Paris"),
        ("Which planet is the largest in the solar system?", "Jupiter"),
        ("Who created the Python programming language?", "Python"),
        ("What is Germany's capital city?", "Berlin"),
    ],
)
def test_search_ranks_the_answering_passage_first(
    filled: sessionmaker[Session], question: str, title: str
) -> None:
    with filled() as session:
        hits = kb.search(session, question, 3)
    assert hits and hits[0].title == title
    assert len(hits) <= 3
    assert [hit.rank for hit in hits] == sorted((hit.rank for hit in hits), reverse=True)
    assert all(hit.rank > 0 for hit in hits)  # SQLite's bm25 negated: higher is better


def test_search_stems_words(filled: sessionmaker[Session]) -> None:
    with filled() as session:
        [hit] = kb.search(session, "Running", 5)
        assert kb.search(session, "run", 5) == [hit]
    assert hit.source == "sport" and "runs" in hit.text


@pytest.mark.parametrize("query", HOSTILE)
def test_hostile_or_empty_queries_never_raise(filled: sessionmaker[Session], query: str) -> None:
    with filled() as session:
        hits = kb.search(session, query, 5)
        assert kb.count(session) == len(PASSAGES)
    assert all(isinstance(hit, kb.Hit) for hit in hits)
    if not kb.query_terms(query):
        assert hits == []


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(query=st.text(max_size=60))
def test_any_text_is_a_valid_query(filled: sessionmaker[Session], query: str) -> None:
    with filled() as session:
        hits = kb.search(session, query, 2)
    assert len(hits) <= 2
    assert [hit.rank for hit in hits] == sorted((hit.rank for hit in hits), reverse=True)
    assert {(hit.source, hit.title) for hit in hits} <= {(p.source, p.title) for p in PASSAGES}
    if not kb.query_terms(query):
        assert hits == []


def test_index_follows_updates_and_deletes(filled: sessionmaker[Session]) -> None:
    with filled.begin() as session:
        session.execute(text("UPDATE kb_passages SET text = 'Rome is in Italy.', title = ''"))
        session.execute(text("DELETE FROM kb_passages WHERE source = 'code'"))
    with filled() as session:
        assert kb.search(session, "Paris France Jupiter", 5) == []
        assert len(kb.search(session, "Italy", 5)) == 4
        assert kb.search(session, "python", 5) == []
        with pytest.raises(ValueError, match="k must be at least 1"):
            kb.search(session, "Italy", 0)


def test_downgrade_drops_the_knowledge_base(url: str) -> None:
    config = alembic_config(url)
    command.downgrade(config, "0002")
    engine = make_engine(url)
    try:
        tables = set(inspect(engine).get_table_names())
        assert not {name for name in tables if name.startswith("kb_")}
        assert "job_runs" in tables
    finally:
        engine.dispose()
    upgrade(url)


def test_other_databases_are_refused() -> None:
    # A mock engine carries a real MySQL dialect and never connects: no server needed.
    engine = cast(Engine, create_mock_engine("mysql://", lambda *args, **kwargs: None))
    with Session(bind=engine) as session, pytest.raises(ValueError, match="SQLite or PostgreSQL"):
        kb.search(session, "paris", 3)


def test_query_terms_drop_stop_words_and_single_characters() -> None:
    assert kb.query_terms("What is the Capital of FRANCE, capital?") == ["capital", "france"]
    assert kb.query_terms("a I x 42 z9") == ["42", "z9"]
    assert kb.query_terms(" ".join(f"w{i}" for i in range(40))) == [f"w{i}" for i in range(32)]


def test_chunk_splits_at_paragraphs_and_sentences_and_caps() -> None:
    doc = "Title line\n\nFirst  sentence here. Second one!\nThird?\n\n\nShort para."
    assert kb.chunk(doc, 1000) == ["Title line First sentence here. Second one! Third? Short para."]
    assert kb.chunk(doc, 30) == [
        "Title line",
        "First sentence here.",
        "Second one! Third? Short para.",  # 30: paragraphs pack together
    ]
    assert kb.chunk("one two three four", 9) == ["one two", "three", "four"]
    assert kb.chunk("abcdefghij", 4) == ["abcd", "efgh", "ij"]
    assert kb.chunk(" \n\n \t", 10) == []
    with pytest.raises(ValueError, match="max_chars"):
        kb.chunk("text", 0)


@given(st.text(alphabet=st.sampled_from("ab .!\n\t"), max_size=300), st.integers(1, 40))
def test_chunks_are_capped_and_keep_every_character(doc: str, max_chars: int) -> None:
    chunks = kb.chunk(doc, max_chars)
    assert all(
        0 < len(piece) <= max_chars and piece == kb.squash_whitespace(piece) for piece in chunks
    )
    assert "".join(chunks).replace(" ", "") == "".join(doc.split())


def test_halueval_knowledge_is_deduplicated_in_order() -> None:
    rows = [("K1", "Q1"), ("K2", "Q2"), ("K1", "Q3"), ("  ", "Q4"), ("K3", "Q5")]
    data = "\n".join(
        json.dumps({"knowledge": k, "question": q, "right_answer": "r", "hallucinated_answer": "h"})
        for k, q in rows
    ).encode()
    assert parse_halueval_knowledge(data) == ["K1", "K2", "K3"]
    corpus = CORPORA["halueval-knowledge"]
    assert corpus.parse is parse_halueval_knowledge
    assert corpus.member == CORPORA["halueval"].member == HALUEVAL_QA


# --- the CLI -------------------------------------------------------------------------------


@pytest.fixture
def cli_home(url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPARSEGUARD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SPARSEGUARD_STORAGE__URL", url)
    return tmp_path


def test_cli_ingests_once_and_searches(cli_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    notes = cli_home / "notes.txt"
    notes.write_text("\n\n".join(f"{p.title}\n{p.text}" if p.title else p.text for p in PASSAGES))
    assert main(["kb", "search", "capital"]) == 0
    assert "sparseguard kb ingest" in capsys.readouterr().out
    assert main(["kb", "ingest", str(notes), "--source", "notes"]) == 0
    assert f"ingested 5 new passages (0 already present) from {notes}" in capsys.readouterr().out
    assert main(["kb", "ingest", str(notes), "--chunk-chars", "800"]) == 0
    out = capsys.readouterr().out
    assert "ingested 0 new passages (5 already present)" in out and "holds 5 passages" in out
    assert main(["kb", "search", "Who created Python?", "--json", "--k", "2"]) == 0
    hits = json.loads(capsys.readouterr().out)
    assert hits[0]["title"] == "Python" and hits[0]["source"] == "notes"
    assert hits[0]["text"].startswith("Python Python is a programming language")
    assert main(["kb", "search", "largest planet"]) == 0
    assert "[notes]  Jupiter" in capsys.readouterr().out


def test_cli_bad_spec_fails_before_writing(
    cli_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = cli_home / "good.txt"
    good.write_text("Some text.\n")
    assert main(["kb", "ingest", str(good), str(cli_home / "missing.txt")]) == 2
    err = capsys.readouterr().err
    assert "sparseguard: error:" in err and "missing.txt" in err and "neither a known corpus" in err
    assert main(["kb", "search", "text"]) == 0
    assert "the knowledge base is empty" in capsys.readouterr().out
