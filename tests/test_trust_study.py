"""The parts of the trust studies that decide their figures: passage-disjoint halves, the
length-matched control spans, the retrieval policies' arithmetic and route threshold, each
matrix cell's baselines, the learning curve's samples and picture, and what the temperature
study counts as a loop."""

from __future__ import annotations

import argparse
import math
import random
from pathlib import Path

import pytest

from services.cli.retrieval_figures import baselines, fixes, perfect_detector, policy
from services.cli.retrieval_study import _learned_routes
from services.cli.temperature_study import looped
from services.cli.trust_study import _fit_n, _judged, _plot, _pooled, _sizes
from sparse_engine.evaluation.ranking import auroc
from sparse_engine.trust.evaluate import QARecord
from sparse_engine.trust.features import RequestSignals
from sparse_engine.trust.flagging import tolerance_floor
from sparse_engine.trust.model import fit, out_of_fold
from sparse_engine.trust.proxy import control_answers, length_matched
from sparse_engine.trust.qa import QAItem, answer_terms, qa_sample

PASSAGE = (
    "The bridge opened in 1932 after six years of work. Its main span is 503 metres long. "
    "Engineers from Sydney and London designed the steel arch together."
)


def test_halves_never_share_a_passage() -> None:
    items = [QAItem(f"q{i}", ("a",), f"passage {i // 3}") for i in range(300)]  # 3 per passage
    fit_half, eval_half = qa_sample(items, "fit", 50), qa_sample(items, "eval", 50)
    assert fit_half and eval_half and not set(fit_half) & set(eval_half)
    assert not {items[i].context for i in fit_half} & {items[i].context for i in eval_half}
    assert len(fit_half) + len(eval_half) == 100  # the grid of 2n, split between them
    with pytest.raises(ValueError, match="choose one of fit, eval"):
        qa_sample(items, "test", 10)


@pytest.mark.parametrize(
    ("gold", "kind"), [("1932", "number"), ("Sydney", "name"), ("steel arch", "words")]
)
def test_control_spans_match_the_gold_in_kind_and_length(gold: str, kind: str) -> None:
    item = QAItem("question?", (gold,), PASSAGE)
    pair = length_matched(item, random.Random(0))
    assert pair is not None
    right, wrong = pair
    assert answer_terms(right) == answer_terms(gold)
    assert len(wrong.split()) == len(gold.split()) and wrong in PASSAGE.replace(".", "")
    assert not set(answer_terms(wrong)) & set(answer_terms(gold))
    is_number = any(ch.isdigit() for ch in wrong)
    assert is_number == (kind == "number")
    if kind == "name":
        assert all(w[:1].isupper() for w in wrong.split())


def test_control_pairs_skip_golds_the_passage_does_not_hold() -> None:
    items = [QAItem("q?", ("Melbourne",), PASSAGE), QAItem("q?", ("503",), PASSAGE)]
    given = control_answers(items, [0, 1])
    assert [(g.record, g.item, g.right) for g in given] == [(2, 1, True), (3, 1, False)]


def test_retrieval_policy_arithmetic() -> None:
    # Four questions: closed book right on the two trusted ones; retrieval fixes one of the
    # two untrusted ones and breaks nothing the trust threshold keeps.
    first = [(True, 0.9), (True, 0.8), (False, 0.1), (False, 0.2)]
    second = [(False, 0.5), (True, 0.5), (True, 0.5), (False, 0.5)]
    got = policy(first, second, threshold=0.5)
    assert (got["never"], got["always"], got["on_low_trust"]) == (0.5, 0.5, 0.75)
    assert got["regenerated"] == 0.5 and got["gain_recovered"] is None  # always gains nothing
    assert got["curve"][0] == (0.0, 0.5) and got["curve"][2] == (0.5, 0.75)
    assert got["curve"][-1] == (1.0, got["always"])
    why = fixes(first, second, match=[3.0, 1.0, 2.0, 0.0])
    assert (why["fixes"], why["breaks"]) == (1, 1)
    assert why["trust_auroc_right"] == 1.0  # the two right answers are the trusted ones
    assert why["low_trust_auroc_fix"] == 1.0  # the fix is the least trusted answer
    assert why["match_auroc_fix"] == round(2 / 3, 4)  # its passage ranks above two of three
    # One fix and one break: no net gain, nothing to recover. Without the break, a perfect
    # detector retries only the two wrong answers: a budget of two requests holds both (the
    # fix for sure), a budget of one holds one of them (the fix by chance: half the gain).
    assert perfect_detector(first, second, budget=0.5) is None
    kept = [(True, 0.9), (True, 0.8), (True, 0.5), (False, 0.5)]  # the break is gone
    assert perfect_detector(first, kept, budget=0.5) == 1.0
    assert perfect_detector(first, kept, budget=0.25) == 0.5  # one of the two wrong, by chance


def test_a_route_threshold_keeps_its_budget_with_the_confidence_asked() -> None:
    # For uniform scores the share of new answers under a threshold is the threshold itself:
    # over many fit samples it must be within the budget in at least 90 % of them, and the
    # next order statistic up must not be (the bound is the tightest one).
    rng = random.Random(1)
    for n, budget in ((46, 0.5), (200, 0.5), (100, 0.1)):
        within = within_next = 0
        for _ in range(2000):
            ordered = sorted(rng.random() for _ in range(n))
            threshold = tolerance_floor(ordered, budget, 0.9)
            k = ordered.index(threshold) + 1
            within += threshold <= budget
            within_next += ordered[k] <= budget
        assert within / 2000 >= 0.88, (n, budget, within)
        assert within_next / 2000 < 0.92, (n, budget, within_next)
    assert math.isinf(tolerance_floor([0.1, 0.2, 0.3], 0.5, 0.9))  # 3 answers: too few
    assert tolerance_floor([], 0.5, 0.9) == -math.inf


def test_out_of_fold_scores_are_those_of_answers_the_fit_never_saw() -> None:
    # Labels that carry signal in mean log-probability rank well out of fold too; labels that
    # are noise rank at chance out of fold, though the fit on all the data has seen them.
    rng = random.Random(5)
    signals = [RequestSignals(mean_logprob=rng.gauss(0.0, 1.0), length=rng.randint(1, 9))
               for _ in range(200)]  # fmt: skip
    for labels, low, high in (
        ([s.mean_logprob + rng.gauss(0.0, 0.5) > 0 for s in signals], 0.85, 1.0),
        ([rng.random() < 0.5 for _ in signals], 0.3, 0.65),
    ):
        model = fit(signals, labels, model_id="m", level="balanced", fit_data={})
        held_out = out_of_fold(signals, labels, model)
        assert len(held_out) == 200 and all(0.0 <= s <= 1.0 for s in held_out)
        assert low <= auroc(held_out, labels) <= high
    answers = [(s.mean_logprob > 0, 0.5) for s in signals]
    got = baselines(answers, signals)
    assert got["mean_logprob"] == 1.0 and got["answer_length"] is not None
    assert got["answer_length"] < 0.65 and set(got) == {
        "answer_length", "mean_logprob", "min_logprob", "mean_entropy"}  # fmt: skip


def test_matrix_cells_report_the_best_baseline_in_its_better_direction() -> None:
    rng = random.Random(3)
    records = []
    for i in range(120):
        right = i % 2 == 0
        sig = RequestSignals(mean_logprob=rng.gauss(-0.5 if right else -1.5, 0.4), length=i % 7)
        records.append(QARecord(i, "x", right, float(right), right, sig, in_passage=not right))
    model = fit([r.signals for r in records], [r.correct for r in records], model_id="m",
                level="balanced", fit_data={})  # fmt: skip
    cell = _judged(model, records)
    assert cell["best_baseline"] == "in_passage" and cell["best_baseline_auroc"] == 1.0
    assert cell["trust_auroc"] > 0.8 and cell["n"] == 120 and cell["wrong"] == 60


def test_the_matrix_fit_halves_default_to_the_eval_size_and_reject_nonsense() -> None:
    assert _fit_n(argparse.Namespace(n=600, fit_n=None)) == 600
    assert _fit_n(argparse.Namespace(n=600, fit_n=300)) == 300
    with pytest.raises(ValueError, match="--fit-n must be at least 1"):
        _fit_n(argparse.Namespace(n=600, fit_n=0))


def test_the_curve_grows_nested_fit_samples_and_draws_them(tmp_path: Path) -> None:
    def sizes(n: int, given: str | None = None) -> list[int]:
        return _sizes(argparse.Namespace(n=n, sizes=given))

    assert sizes(600) == [150, 300, 600] and sizes(600, "600,100, 200") == [100, 200, 600]
    for bad, message in [("0,10", "between 1 and --n"), ("700", "between 1 and --n"),
                         ("a,b", "whole numbers"), (",", "between 1 and --n")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            sizes(600, bad)
    items = [QAItem(f"q{i}", ("a",), f"passage {i // 2}") for i in range(1500)]
    largest = set(qa_sample(items, "fit", 600))
    for smaller in (150, 300):  # a smaller sample is part of the larger one: the curve is nested
        assert set(qa_sample(items, "fit", smaller)) < largest
    pools = _pooled(["a", "b", "c"])
    assert pools["all"] == (["a", "b", "c"], ["a", "b", "c"])
    assert pools["all but b"] == (["a", "c"], ["b"]) and len(pools) == 4
    points = [
        {"size": size, "fit": fit_on, "test": test, "trust_auroc": 0.6, "best_baseline_auroc": 0.55}
        for size in (150, 600)
        for fit_on, tests in pools.items()
        for test in tests[1]
    ]
    png = _plot(tmp_path / "curve.png", ["a", "b", "c"], points)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_loop_is_a_three_token_sequence_four_times() -> None:
    assert looped([1, 2, 3] * 4)
    assert not looped([1, 2, 3] * 3 + [9])  # three times is not yet a loop
    assert not looped(list(range(40))) and not looped([]) and not looped([5, 5])
    assert looped([7] * 6)  # one token repeated: (7, 7, 7) four times


def test_the_gain_route_retries_the_answers_retrieval_fixes() -> None:
    # Closed book, an answer is right when its mean log-probability is high; retrieval makes
    # it right when its answer is long (a near miss) and breaks nothing. Least trusted first
    # retries the hopeless short answers; the expected gain finds the long wrong ones.
    rng = random.Random(7)

    def half(
        n: int,
    ) -> tuple[list[RequestSignals], list[tuple[bool, float]], list[tuple[bool, float]]]:
        signals = [RequestSignals(mean_logprob=rng.gauss(0.0, 1.0), length=rng.randint(1, 9))
                   for _ in range(n)]  # fmt: skip
        first = [(s.mean_logprob > 1.0, 0.5) for s in signals]
        second = [(r or s.length > 6, 0.5) for (r, _), s in zip(first, signals, strict=True)]
        return signals, first, second

    test = half(300)
    args = argparse.Namespace(data="halueval", budget=0.5, confidence=0.9)
    routes = _learned_routes(("m", "balanced", args), half(300), test, [0.0] * 300)
    route, gain = routes["route_model"], routes["gain_model"]
    assert route["retrieval_fixes"]["trust_auroc_right"] > 0.9
    assert gain["retrieval_fixes"]["low_trust_auroc_fix"] > 0.8
    assert (
        route["retrieval_fixes"]["low_trust_auroc_fix"]
        < gain["retrieval_fixes"]["low_trust_auroc_fix"]
    )
    assert gain["retrieve_at_budget"]["regenerated"] <= 0.55
    assert (
        gain["retrieve_at_budget"]["gain_recovered"] > route["retrieve_at_budget"]["gain_recovered"]
    )
    # A stored closed-mode model (what the gateway serves) takes the trust route's place: its
    # scores rank the eval half, its setting refit per fold sets the threshold.
    signals, first, _ = half(300)
    right = [r for r, _ in first]
    served = fit(signals, right, model_id="m", level="balanced", fit_data={}, mode="closed")
    served.version = "trust-closed-balanced-x"
    again = _learned_routes(("m", "balanced", args), (signals, first, first), test, [0.0] * 300,
                            served)["route_model"]  # fmt: skip
    assert (again["served"], route["served"]) == (served.version, None)
    assert again["items"] == 300 and again["retrieval_fixes"]["trust_auroc_right"] > 0.9
