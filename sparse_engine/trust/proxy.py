"""Proxy-mode evaluation: answers another model gave (the upstream's), graded like the served
model's own, then scored by the served engine teacher-forcing prompt and answer in one pass, as
the gateway's proxy mode does (`runtime.scoring.score_answer`). And the length-matched control:
per passage item, its gold span and another span of the same passage of the same kind (number,
name, or other words) and the same number of words, so that neither answer length nor "the
answer is in the passage" can tell them apart."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from sparse_engine.runtime.engine import Engine
from sparse_engine.runtime.generation import GenerationRequest
from sparse_engine.runtime.scoring import score_answer
from sparse_engine.sparsity.plan import Level
from sparse_engine.trust.evaluate import QARecord, RecordSet
from sparse_engine.trust.features import from_stats
from sparse_engine.trust.qa import QAItem, answer_terms, grade, in_passage, qa_messages

Progress = Callable[[int], object]


@dataclass(frozen=True, slots=True)
class Given:
    """An answer to score: its record's index, its item's, the text, and whether it is right
    (None: grade it against the item's gold answers)."""

    record: int
    item: int
    text: str
    right: bool | None = None


_WORDS = re.compile(r"\S+")
_EDGE_PUNCTUATION = ".,;:!?\"'()[]"


def upstream_answers(
    upstream: Engine,
    items: Sequence[QAItem],
    indices: Sequence[int],
    max_new_tokens: int,
    path: Path,
    progress: Progress = lambda _: None,
) -> dict[int, str]:
    """The upstream model's greedy, dense answers to `indices`, kept as JSONL at `path` (so an
    interrupted run resumes)."""
    kept: dict[int, str] = {}
    if path.is_file():
        for line in filter(None, path.read_text(encoding="utf-8").splitlines()):
            row = json.loads(line)
            kept[int(row["index"])] = str(row["answer"])
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as sink:
        for index in indices:
            if index not in kept:
                request = GenerationRequest(
                    messages=qa_messages(items[index]),
                    max_new_tokens=max_new_tokens,
                    collect_signals=False,
                    use_prefix_cache=False,
                )
                kept[index] = upstream.generate(request, Level.DENSE).result().text
                sink.write(json.dumps({"index": index, "answer": kept[index]}) + "\n")
                sink.flush()
            progress(1)
    return {i: kept[i] for i in indices}


def score_given(
    engine: Engine,
    items: Sequence[QAItem],
    given: Sequence[Given],
    level: Level,
    records: RecordSet,
    progress: Progress = lambda _: None,
) -> list[QARecord]:
    """Records of given answers, each scored teacher-forced by `engine` with the readout, as
    proxy mode scores an upstream's answer. Cached like the served model's own answers."""
    cached = records.load()
    records.path.parent.mkdir(parents=True, exist_ok=True)
    out = []
    with records.path.open("a", encoding="utf-8") as sink:
        for answer in given:
            record = cached.get(answer.record)
            if record is None:
                record = _scored(engine, items[answer.item], answer, level)
                sink.write(record.to_json() + "\n")
                sink.flush()
            out.append(record)
            progress(1)
    return out


def _scored(engine: Engine, item: QAItem, answer: Given, level: Level) -> QARecord:
    messages = qa_messages(item)
    stats = score_answer(engine, messages, answer.text, level, True, readout=True)
    g = grade(answer.text, item.answers)
    right = g.correct if answer.right is None else answer.right
    signals = from_stats(stats, messages[0]["content"])
    inside = in_passage(answer.text, item)
    return QARecord(answer.record, answer.text, g.contains, g.f1, right, signals, g.exact, inside)


def control_answers(items: Sequence[QAItem], indices: Sequence[int]) -> list[Given]:
    """Per item whose gold answer appears word for word in its passage and whose passage has
    another span of that kind and length: the gold span (record 2i, right) and the other span
    (record 2i + 1, wrong)."""
    out = []
    for index in indices:
        pair = length_matched(items[index], random.Random(index))
        if pair is not None:
            out += [
                Given(2 * index, index, pair[0], True),
                Given(2 * index + 1, index, pair[1], False),
            ]
    return out


def length_matched(item: QAItem, rng: random.Random) -> tuple[str, str] | None:
    """(gold span as the passage writes it, another span of the same kind and word count that
    shares no word with any gold answer and stays inside one sentence), or None."""
    raw = _WORDS.findall(item.context)
    words = [w.strip(_EDGE_PUNCTUATION) for w in raw]
    ends = [w.rstrip("\"')]").endswith((".", "!", "?")) for w in raw]
    gold_terms = [answer_terms(g) for g in item.answers]
    for gold in item.answers:
        size = len(gold.split())
        terms = answer_terms(gold)
        spans = [
            words[i : i + size]
            for i in range(len(words) - size + 1)
            if not any(ends[i : i + size - 1])
        ]
        found = [" ".join(s) for s in spans if answer_terms(" ".join(s)) == terms]
        if not terms or not found:
            continue
        kind = _kind(found[0])
        others = [
            " ".join(s)
            for s in spans
            if all(s) and _kind(" ".join(s)) == kind and _disjoint(" ".join(s), gold_terms)
        ]
        if others:
            return found[0], rng.choice(others)
    return None


def _kind(span: str) -> str:
    if any(ch.isdigit() for ch in span):
        return "number"
    if all(w[:1].isupper() for w in span.split()):
        return "name"
    return "words"


def _disjoint(span: str, gold_terms: list[list[str]]) -> bool:
    said = set(answer_terms(span))
    return not any(said & set(terms) for terms in gold_terms)
