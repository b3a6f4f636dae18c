"""Does the trust signal work? The model answers QA items; each answer is graded and kept with
its signals as a record (cached as JSONL, so fitting and evaluating reuse the same answers);
AUROC says how well a score ranks wrong answers above right ones."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from sparse_engine.runtime.engine import Engine
from sparse_engine.runtime.generation import GenerationRequest
from sparse_engine.runtime.offline import generate_all
from sparse_engine.sparsity.plan import Level
from sparse_engine.sparsity.readout import AnswerReadout
from sparse_engine.trust.features import RequestSignals, from_stats
from sparse_engine.trust.qa import QAItem, grade, in_passage, qa_messages

log = logging.getLogger(__name__)
RECORD_FORMAT = 3  # 2: the channel probe; 3: the readout, alias-aware grades. Older: answered again


@dataclass(slots=True)
class QARecord:
    index: int
    answer: str
    contains: bool
    f1: float
    correct: bool
    signals: RequestSignals  # with the answer's readout
    exact: bool = False
    in_passage: bool = False  # the answer is word for word in the item's passage

    def to_json(self) -> str:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["signals"] = self.signals.to_dict()
        data["readout"] = data["signals"].pop("readout")  # kept apart: the bulk of a record
        return json.dumps(data)

    @classmethod
    def from_json(cls, line: str) -> QARecord:
        data = json.loads(line)
        readout = data.pop("readout", None)
        signals = RequestSignals.from_dict(data["signals"])
        signals.readout = AnswerReadout.from_dict(readout) if readout else None
        return cls(**{**data, "signals": signals})


@dataclass(frozen=True, slots=True)
class RecordSet:
    """Where the answers to one data spec, under one engine setup, are kept."""

    root: Path
    data: str
    model: str
    calibration: str
    max_new_tokens: int

    @property
    def path(self) -> Path:
        slug = re.sub(r"[^A-Za-z0-9]+", "-", f"{self.data}-{self.model}-{self.calibration}").strip(
            "-"
        )
        return self.root / f"{slug}-{self.max_new_tokens}t-v{RECORD_FORMAT}.jsonl"

    def load(self) -> dict[int, QARecord]:
        if not self.path.is_file():
            return {}
        lines = self.path.read_text(encoding="utf-8").splitlines()
        return {r.index: r for r in map(QARecord.from_json, filter(None, lines))}


def answer_all(
    engine: Engine,
    items: Sequence[QAItem],
    indices: Sequence[int],
    level: Level,
    max_new_tokens: int,
) -> list[QARecord]:
    """Greedy answers at `level` to `items[i]` for i in `indices`, batched as served
    (`runtime.offline`), with drift measured, graded against the gold answers."""
    jobs = [(_request(items[i], max_new_tokens), level) for i in indices]
    records = []
    for index, stats in zip(indices, generate_all(engine, jobs), strict=True):
        item = items[index]
        g = grade(stats.text, item.answers)
        signals = from_stats(stats, qa_messages(item)[0]["content"])
        inside = in_passage(stats.text, item)
        records.append(
            QARecord(index, stats.text, g.contains, g.f1, g.correct, signals, g.exact, inside)
        )
    return records


def _request(item: QAItem, max_new_tokens: int) -> GenerationRequest:
    return GenerationRequest(
        messages=qa_messages(item),
        max_new_tokens=max_new_tokens,
        measure_drift=True,
        use_prefix_cache=False,
        readout=True,
    )


CHUNK = 32  # answers batched at once and then appended (an interrupted run loses at most these)


def collect(
    engine: Engine,
    items: Sequence[QAItem],
    indices: Sequence[int],
    level: Level,
    records: RecordSet,
    progress: Callable[[int], object] = lambda _: None,
) -> list[QARecord]:
    """Records for `indices` of `items`: cached ones are read back, missing ones are answered
    and appended as they come, so an interrupted run resumes where it stopped."""
    cached = records.load()
    records.path.parent.mkdir(parents=True, exist_ok=True)
    missing = [i for i in indices if i not in cached]
    progress(len(indices) - len(missing))
    with records.path.open("a", encoding="utf-8") as sink:
        for start in range(0, len(missing), CHUNK):
            for record in answer_all(
                engine, items, missing[start : start + CHUNK], level, records.max_new_tokens
            ):
                sink.write(record.to_json() + "\n")
                cached[record.index] = record
            sink.flush()
            progress(len(missing[start : start + CHUNK]))
    return [cached[i] for i in indices]
