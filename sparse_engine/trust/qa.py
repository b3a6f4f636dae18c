"""Question answering with a passage: items from a packaged QA set (`data.qa_sets`: HaluEval,
CoQA, SQuADShifts reddit and amazon) or a plain JSONL file, the prompt the model answers, and
grading of an answer against the gold answers: normalised exact match, containment and token F1
as in SQuAD's evaluation, alias-aware. Before comparing, words are reduced to a light stem and
number words to digits, so "fascist" matches "Fascism", "fifty" matches "50" and "1,000"
matches "1000"."""

from __future__ import annotations

import hashlib
import json
import re
import string
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from sparse_engine.data.qa_sets import QA_SETS, QAItem, qa_items
from sparse_engine.runtime.generation import Message

__all__ = [
    "HALUEVAL",
    "SPLITS",
    "Grade",
    "QADataError",
    "QAItem",
    "grade",
    "in_passage",
    "load_qa",
    "qa_messages",
    "qa_sample",
]
SPLITS = ("fit", "eval")

HALUEVAL = "halueval"
F1_CORRECT = 0.5  # an answer with token F1 at or above this counts as right
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)
_UNITS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen twenty"
)
_TENS = "thirty forty fifty sixty seventy eighty ninety"
_NUMBER_WORDS = {w: str(v) for v, w in enumerate(_UNITS.split())} | {
    w: str(10 * v) for v, w in enumerate(_TENS.split(), 3)
}
# Longest first; a suffix comes off only when three letters stay (so "is", "gas" keep theirs).
_SUFFIXES = ("isms", "ists", "ians", "ism", "ist", "ian", "ing", "ies", "es", "ed", "s")


class QADataError(ValueError):
    """A QA data spec that cannot be read; the message says what shape is expected."""


@dataclass(frozen=True, slots=True)
class Grade:
    contains: bool
    f1: float
    exact: bool = False

    @property
    def correct(self) -> bool:
        return self.exact or self.contains or self.f1 >= F1_CORRECT


def load_qa(spec: str, home: Path) -> list[QAItem]:
    """A packaged QA set by name, or a JSONL file with `question`, `answer` or `answers` (a list
    of acceptable answers), and optionally `context` (or `knowledge`)."""
    if spec in QA_SETS:
        return qa_items(spec, home)
    path = Path(spec)
    if not path.is_file():
        raise QADataError(
            f"no QA data {spec!r}: give one of {', '.join(QA_SETS)} or a JSONL file path"
        )
    return [_item(row, num, path) for num, row in _rows(path)]


def qa_sample(items: list[QAItem], split: str, n: int) -> list[int]:
    """About `n` item indices of one half of the set: a grid of 2n items spread evenly over
    it, kept where the item's passage (its question, without one) falls in `split` ('fit' or
    'eval') by hash, so no passage is in both halves and a fit never sees the passages it is
    evaluated on."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    if n < 1:
        raise ValueError("n must be at least 1")
    grid = sorted({k * len(items) // (2 * n) for k in range(min(2 * n, len(items)))})
    return [i for i in grid if passage_split(items[i]) == split]


def passage_split(item: QAItem) -> str:
    key = (item.context or item.question).encode("utf-8")
    return SPLITS[hashlib.sha256(key).digest()[0] % 2]


def in_passage(answer: str, item: QAItem) -> bool:
    """Whether the answer appears word for word (after normalising) in the item's passage."""
    return _contains(answer_terms(item.context), answer_terms(answer)) if answer.strip() else False


def qa_messages(item: QAItem) -> list[Message]:
    text = f"Question: {item.question}\nAnswer in a few words."
    if item.context:
        text = f"Use this passage to answer.\n\nPassage: {item.context}\n\n{text}"
    return [{"role": "user", "content": text}]


def normalise_answer(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces."""
    text = _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION))
    return " ".join(text.split())


def answer_terms(text: str) -> list[str]:
    """The normalised words, number words as digits, each cut to a light stem."""
    return [_stem(_NUMBER_WORDS.get(w, w)) for w in normalise_answer(text).split()]


def _stem(word: str) -> str:
    for suffix in _SUFFIXES:
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            return word[: -len(suffix)]
    return word


def token_f1(answer: str, gold: str) -> float:
    predicted, truth = answer_terms(answer), answer_terms(gold)
    common = sum((Counter(predicted) & Counter(truth)).values())
    if not common:
        return 0.0
    precision, recall = common / len(predicted), common / len(truth)
    return 2 * precision * recall / (precision + recall)


def grade(answer: str, golds: tuple[str, ...]) -> Grade:
    """The best exact match, containment and F1 over the acceptable answers."""
    said = answer_terms(answer)
    truths = [t for t in map(answer_terms, golds) if t]
    return Grade(
        contains=any(_contains(said, t) for t in truths),
        f1=max((token_f1(answer, g) for g in golds), default=0.0),
        exact=any(said == t for t in truths),
    )


def _contains(said: list[str], gold: list[str]) -> bool:
    n = len(gold)
    return n > 0 and any(said[i : i + n] == gold for i in range(len(said) - n + 1))


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
