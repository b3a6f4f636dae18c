"""The default golden set, external references only: the MT-Bench first turns that carry a
packaged GPT-4 reference answer (scored with chrF) and HaluEval questions asked with their
knowledge passage (scored with token F1 against the gold short answer). Built from the
packaged data; no model runs, so no reference is a model's own answer."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from services.workers.golden_set import LONG_METRIC, SHORT_METRIC, GoldenItem
from sparse_engine.data.corpora import (
    HaluEvalItem,
    MTBenchQuestion,
    halueval_items,
    mtbench_questions,
    mtbench_references,
)
from sparse_engine.trust.qa import QAItem, qa_messages

GPT4_SOURCE = "gpt-4"
HALUEVAL_SOURCE = "halueval"
# 30 MT-Bench questions carry a GPT-4 reference (math, reasoning, coding); 70 HaluEval
# questions make the default 100 items. See the README for the measured interval widths.
DEFAULT_HALUEVAL_ITEMS = 70


def mtbench_golden(
    questions: Sequence[MTBenchQuestion], references: dict[int, str]
) -> list[GoldenItem]:
    """The first turns that have a packaged GPT-4 reference answer, scored with chrF."""
    return [
        GoldenItem(
            f"mtbench-{q.question_id}",
            q.turns[0],
            references[q.question_id],
            GPT4_SOURCE,
            LONG_METRIC,
        )
        for q in questions
        if q.question_id in references
    ]


def halueval_golden(items: Sequence[HaluEvalItem], count: int) -> list[GoldenItem]:
    """`count` HaluEval QA items spread evenly over the data set, asked with their knowledge
    passage as the trust evaluation asks them, scored with token F1 against the gold answer."""
    if count < 0:
        raise ValueError(f"the HaluEval item count must be >= 0, got {count}")
    if count > len(items):
        raise ValueError(f"asked for {count} HaluEval items but the data set has {len(items)}")
    stride = len(items) // count if count else 1
    golden = []
    for index in range(0, stride * count, stride):
        item = items[index]
        qa = QAItem(item.question.strip(), (item.right_answer,), item.knowledge.strip())
        prompt = qa_messages(qa)[0]["content"]
        golden.append(
            GoldenItem(
                f"halueval-{index}", prompt, item.right_answer, HALUEVAL_SOURCE, SHORT_METRIC
            )
        )
    return golden


def default_golden(
    cache_home: Path, halueval_count: int = DEFAULT_HALUEVAL_ITEMS
) -> list[GoldenItem]:
    """MT-Bench first turns with a GPT-4 reference and `halueval_count` HaluEval questions
    (packaged data fetched into `cache_home`). No model is run: every reference is external."""
    questions = mtbench_questions(cache_home)
    mtbench = mtbench_golden(questions, mtbench_references(cache_home))
    return mtbench + halueval_golden(halueval_items(cache_home), halueval_count)
