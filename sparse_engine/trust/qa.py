"""Question answering with a passage: items from HaluEval or a plain JSONL file, the prompt the
model answers, and scoring of an answer against the gold answers (normalised containment and
token F1, as in SQuAD's evaluation)."""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from sparse_engine.data.corpora import halueval_items
from sparse_engine.runtime.generation import Message

HALUEVAL = "halueval"
F1_CORRECT = 0.5  # an answer with token F1 at or above this counts as right
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


class QADataError(ValueError):
    """A QA data spec that cannot be read; the message says what shape is expected."""


@dataclass(frozen=True, slots=True)
class QAItem:
    question: str
    answers: tuple[str, ...]
    context: str = ""


@dataclass(frozen=True, slots=True)
class Grade:
    contains: bool
    f1: float

    @property
    def correct(self) -> bool:
        return self.contains or self.f1 >= F1_CORRECT


def load_qa(spec: str, home: Path) -> list[QAItem]:
    """`halueval`, or a JSONL file with `question`, `answer` or `answers` (a list of
    acceptable answers), and optionally `context` (or `knowledge`)."""
    if spec == HALUEVAL:
        return [QAItem(i.question, (i.right_answer,), i.knowledge) for i in halueval_items(home)]
    path = Path(spec)
    if not path.is_file():
        raise QADataError(f"no QA data {spec!r}: give 'halueval' or a JSONL file path")
    return [_item(row, num, path) for num, row in _rows(path)]


def qa_messages(item: QAItem) -> list[Message]:
    text = f"Question: {item.question}\nAnswer in a few words."
    if item.context:
        text = f"Use this passage to answer.\n\nPassage: {item.context}\n\n{text}"
    return [{"role": "user", "content": text}]


def normalise_answer(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces."""
    text = _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION))
    return " ".join(text.split())


def token_f1(answer: str, gold: str) -> float:
    predicted, truth = normalise_answer(answer).split(), normalise_answer(gold).split()
    common = sum((Counter(predicted) & Counter(truth)).values())
    if not common:
        return 0.0
    precision, recall = common / len(predicted), common / len(truth)
    return 2 * precision * recall / (precision + recall)


def grade(answer: str, golds: tuple[str, ...]) -> Grade:
    """The best containment and F1 over the acceptable answers."""
    said = f" {normalise_answer(answer)} "
    contains = any(g and f" {g} " in said for g in map(normalise_answer, golds))
    return Grade(contains, max((token_f1(answer, g) for g in golds), default=0.0))


def _rows(path: Path) -> list[tuple[int, object]]:
    rows = []
    for num, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append((num, json.loads(line)))
            except json.JSONDecodeError as exc:
                raise QADataError(f"{path}:{num}: not JSON ({exc.msg})") from None
    if not rows:
        raise QADataError(f"{path} holds no items")
    return rows


def _item(row: object, num: int, path: Path) -> QAItem:
    where = f"{path}:{num}"
    if not isinstance(row, dict) or not isinstance(row.get("question"), str):
        raise QADataError(f"{where}: each line needs a 'question' string")
    answers = row.get("answers", [row["answer"]] if "answer" in row else None)
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        raise QADataError(f"{where}: give 'answer' (a string) or 'answers' (a list of strings)")
    context = row.get("context", row.get("knowledge", ""))
    if not isinstance(context, str):
        raise QADataError(f"{where}: 'context' must be a string")
    return QAItem(row["question"], tuple(answers), context)
