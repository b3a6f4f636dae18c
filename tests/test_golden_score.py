"""Golden-set scoring: the per-item metrics (token F1, chrF, BLEU in points), the paired
bootstrap and the status its interval gives against a budget, and one level's drift from the
dense and sparse answers. The file, the check and the stored runs: tests/test_golden.py."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.storage.models import GOLDEN_STATUSES
from services.workers import golden_score, golden_set
from services.workers.golden_score import INCONCLUSIVE, OK, OVER_BUDGET, paired_bootstrap
from services.workers.golden_set import GoldenItem

BUDGET = 2.0
SENTENCES = [
    "The cat sat on the mat near the door .",
    "Sparse models skip work that would multiply by zero .",
    "Calibration picks one threshold for every layer of the model .",
]


def items_for(references: list[str], metric: str = "chrf") -> list[GoldenItem]:
    return [
        GoldenItem(f"q{i}", f"prompt {i}", ref, "test", metric) for i, ref in enumerate(references)
    ]


# --- per-item scores ---------------------------------------------------------------------------


def test_every_file_metric_has_a_scorer_and_every_status_a_column_value() -> None:
    assert tuple(golden_score.SCORERS) == golden_set.METRICS
    assert golden_score.STATUSES == GOLDEN_STATUSES == (OK, INCONCLUSIVE, OVER_BUDGET)


def test_token_f1_uses_squad_normalisation_in_points() -> None:
    assert golden_score.score("f1", "The Eiffel Tower!", "eiffel tower") == 100.0
    # 1 of 2 predicted tokens right, 1 of 1 gold: P 1/2, R 1, F1 2/3.
    assert golden_score.score("f1", "Paris France", "paris") == pytest.approx(200 / 3)
    assert golden_score.score("f1", "London", "Paris") == 0.0
    assert golden_score.score("f1", "", "Paris") == 0.0


def test_chrf_and_bleu_score_sentences_in_points() -> None:
    reference = "Sparse models skip work that would multiply by zero."
    for metric in ("chrf", "bleu"):
        assert golden_score.score(metric, reference, reference) == pytest.approx(100.0)
        near = golden_score.score(metric, "Sparse models skip work.", reference)
        far = golden_score.score(metric, "Bananas are yellow.", reference)
        assert 100.0 > near > far >= 0.0
    with pytest.raises(ValueError, match="unknown golden metric 'rouge'"):
        golden_score.score("rouge", "a", "b")


# --- the paired bootstrap and the status ----------------------------------------------------------

scores = st.floats(min_value=0.0, max_value=100.0, allow_nan=False)


@given(st.lists(scores, min_size=1, max_size=40))
def test_identical_answers_give_zero_drift_and_ok(values: list[float]) -> None:
    interval = paired_bootstrap([v - v for v in values])
    assert (interval.mean, interval.low, interval.high) == (0.0, 0.0, 0.0)
    assert golden_score.drift_status(interval.low, interval.high, 0.0) == OK


@given(st.lists(scores, min_size=1, max_size=40), st.floats(min_value=BUDGET + 0.1, max_value=90))
def test_a_constant_shift_over_the_budget_is_over_budget(values: list[float], shift: float) -> None:
    interval = paired_bootstrap([shift] * len(values))
    assert interval.low == pytest.approx(shift) and interval.high == pytest.approx(shift)
    assert golden_score.drift_status(interval.low, interval.high, BUDGET) == OVER_BUDGET


@given(st.lists(st.floats(min_value=-100, max_value=100), min_size=1, max_size=30))
def test_the_interval_holds_the_mean_and_is_seeded(differences: list[float]) -> None:
    interval = paired_bootstrap(differences)
    assert interval.low <= interval.mean <= interval.high
    assert min(differences) - 1e-9 <= interval.low and interval.high <= max(differences) + 1e-9
    assert paired_bootstrap(differences) == interval


def test_few_noisy_items_are_inconclusive() -> None:
    interval = paired_bootstrap([40.0, -30.0, 10.0, -15.0, 5.0])
    assert interval.low < BUDGET < interval.high
    assert golden_score.drift_status(interval.low, interval.high, BUDGET) == INCONCLUSIVE
    # The same mean over many items is narrow enough to decide.
    many = paired_bootstrap([2.0 + (-1) ** i * 0.5 for i in range(200)])
    assert golden_score.drift_status(many.low, many.high, 5.0) == OK
    assert golden_score.drift_status(many.low, many.high, 1.0) == OVER_BUDGET


def test_status_edges() -> None:
    assert golden_score.drift_status(0.0, BUDGET, BUDGET) == OK  # at the budget is ok
    assert golden_score.drift_status(BUDGET, 9.0, BUDGET) == INCONCLUSIVE
    assert golden_score.drift_status(BUDGET + 0.01, 9.0, BUDGET) == OVER_BUDGET


@pytest.mark.parametrize(
    ("differences", "kwargs", "error"),
    [
        ([], {}, "at least one paired difference"),
        ([1.0, math.nan], {}, "must be finite"),
        ([1.0], {"resamples": 0}, "resamples >= 1"),
        ([1.0], {"confidence": 1.0}, "0 < confidence < 1"),
    ],
)
def test_bad_bootstrap_input_is_refused(
    differences: list[float], kwargs: dict[str, float], error: str
) -> None:
    with pytest.raises(ValueError, match=error):
        paired_bootstrap(differences, **kwargs)  # type: ignore[arg-type]


# --- one level's drift -------------------------------------------------------------------------


def test_same_answers_have_no_drift_and_changed_ones_are_counted() -> None:
    items = items_for(SENTENCES)
    same = golden_score.summarize("balanced", "v1", items, SENTENCES, SENTENCES, [0.0, 0.1, 0.2])
    assert same.score_dense == pytest.approx(100.0) and same.metric == "chrf"
    assert (same.drift, same.drift_low, same.drift_high) == (0.0, 0.0, 0.0)
    assert same.answers_changed == 0 and same.prompts == 3 and same.status(0.0) == OK
    assert same.kl_mean == pytest.approx(0.1)

    sparse = [SENTENCES[0], "A different answer entirely here .", SENTENCES[2][:20]]
    drifted = golden_score.summarize("balanced", "v1", items, SENTENCES, sparse, [0.0, 0.5, 0.4])
    assert drifted.answers_changed == 2 and drifted.changed_share == pytest.approx(2 / 3)
    assert drifted.score_sparse < drifted.score_dense
    assert drifted.drift == pytest.approx(drifted.score_dense - drifted.score_sparse)
    assert drifted.drift_low <= drifted.drift <= drifted.drift_high
    rows = drifted.details["items"]
    assert [row["changed"] for row in rows] == [False, True, True]
    assert rows[0]["dense_score"] == rows[0]["sparse_score"] == pytest.approx(100.0)
    assert rows[1]["id"] == "q1" and rows[1]["metric"] == "chrf" and rows[1]["kl"] == 0.5
    assert (rows[1]["dense"], rows[1]["sparse"]) == (SENTENCES[1], sparse[1])


def test_each_item_is_scored_with_its_own_metric() -> None:
    items = [*items_for(["Paris"], "f1"), GoldenItem("long", "p", SENTENCES[1], "t", "chrf")]
    result = golden_score.summarize(
        "aggressive", "v", items, ["Paris", SENTENCES[1]], ["Rome", ""], [0, 0]
    )
    assert result.metric == "chrf+f1"
    assert [row["dense_score"] - row["sparse_score"] for row in result.details["items"]] == [
        pytest.approx(100.0),
        pytest.approx(100.0),
    ]
    assert result.drift == pytest.approx(100.0) and result.over_budget(BUDGET)
    with pytest.raises(ValueError, match="golden set is empty"):
        golden_score.summarize("aggressive", "v", [], [], [], [])
