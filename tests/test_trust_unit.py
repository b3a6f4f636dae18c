"""The trust math on its own: AUROC, answer grading, QA files, the trust model's fit and
store, the rolling baseline, the judge's reasons and the fallback prompts."""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.config import Settings, SignalSettings, TrustSettings
from services.gateway.fallback import route_action, simplified, with_passages
from services.gateway.inputs import ChatInput
from services.gateway.trust import RollingBaseline, TrustJudge
from services.storage.kb import Hit
from sparse_engine.evaluation.ranking import auroc
from sparse_engine.runtime.generation import GenerationRequest, GenerationStats
from sparse_engine.runtime.scoring import score_answer
from sparse_engine.sparsity.plan import Level
from sparse_engine.sparsity.recorder import SignalSummary
from sparse_engine.trust.evaluate import QARecord
from sparse_engine.trust.features import (
    FEATURES,
    RequestSignals,
    SilenceBaseline,
    context_overlap,
    from_stats,
)
from sparse_engine.trust.model import (
    TrustModel,
    TrustModelNotFoundError,
    TrustStore,
    candidates,
    fit,
    group_vectors,
)
from sparse_engine.trust.qa import QADataError, grade, load_qa, normalise_answer, token_f1
from sparse_engine.trust.regression import Group
from sparse_engine.trust.report import report
from tests.tiny import tiny_engine


@given(st.lists(st.tuples(st.integers(0, 5), st.booleans()), min_size=2, max_size=40))
def test_auroc_equals_the_share_of_ordered_pairs(pairs: list[tuple[int, bool]]) -> None:
    scores, labels = [float(s) for s, _ in pairs], [label for _, label in pairs]
    pos = [s for s, label in zip(scores, labels, strict=True) if label]
    neg = [s for s, label in zip(scores, labels, strict=True) if not label]
    got = auroc(scores, labels)
    if not pos or not neg:
        assert got != got  # NaN
        return
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    assert got == pytest.approx(wins / (len(pos) * len(neg)))


def test_grading_normalises_and_takes_the_best_gold_answer() -> None:
    assert normalise_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert grade("It is in Paris, France.", ("paris",)).contains
    assert not grade("Parisian food", ("Paris",)).contains  # whole words only
    # "city of paris" against "paris": precision 1/3, recall 1
    assert token_f1("the city of Paris", "Paris") == pytest.approx(0.5)
    best = grade("Channel 4", ("BBC One", "Channel 4"))
    assert best.contains and best.f1 == 1.0 and best.correct
    assert not grade("I do not know", ("Bomarea",)).correct


def test_qa_files_accept_answer_or_answers_and_reject_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "qa.jsonl"
    rows = [
        {"question": "Capital of France?", "answer": "Paris", "context": "Paris is..."},
        {"question": "Largest planet?", "answers": ["Jupiter", "planet Jupiter"]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    items = load_qa(str(path), tmp_path)
    assert items[0].answers == ("Paris",) and items[0].context == "Paris is..."
    assert items[1].answers == ("Jupiter", "planet Jupiter") and items[1].context == ""
    path.write_text(json.dumps({"question": "no answer"}))
    with pytest.raises(QADataError, match="'answers'"):
        load_qa(str(path), tmp_path)
    path.write_text("{not json")
    with pytest.raises(QADataError, match=r"qa\.jsonl:1: not JSON"):
        load_qa(str(path), tmp_path)
    with pytest.raises(QADataError, match="halueval"):
        load_qa(str(tmp_path / "missing.jsonl"), tmp_path)


def _signals(rng: random.Random, right: bool) -> RequestSignals:
    # Right answers are confident; silence carries no information, as measured on SmolLM2.
    return RequestSignals(
        silence_per_layer=[rng.random() * 0.2 for _ in range(4)],
        mean_logprob=(-0.3 if right else -1.2) + rng.gauss(0, 0.3),
        min_logprob=-2.0 + rng.gauss(0, 0.5),
        mean_entropy=rng.random(),
        length=rng.randint(3, 30),
        drift_kl=rng.random() * 0.1 if rng.random() < 0.5 else None,
    )


def _records(n: int, seed: int) -> list[QARecord]:
    rng = random.Random(seed)
    labels = [rng.random() < 0.4 for _ in range(n)]
    return [
        QARecord(i, "answer", right, 1.0 if right else 0.0, right, _signals(rng, right))
        for i, right in enumerate(labels)
    ]


def test_fit_learns_the_informative_feature_and_generalises(tmp_path: Path) -> None:
    train, test = _records(300, 0), _records(200, 1)
    model = fit(
        [r.signals for r in train],
        [r.correct for r in train],
        model_id="m",
        level="balanced",
        fit_data={"data": "synthetic", "split": "fit", "n": 300},
    )
    assert model.group_names == ["scalar"]  # no readout, no probe: the scalar signals alone
    weights = dict(zip(FEATURES, model.weights, strict=True))
    assert max(weights, key=lambda k: abs(weights[k])) == "mean_logprob"
    assert weights["mean_logprob"] > 0  # more confident -> more likely right
    held = report(test, model, {"data": "synthetic", "split": "eval", "n": 200})
    assert held.held_out is True and held.trust_auroc > 0.9
    # The nested estimate (setting chosen inside each fold) agrees with the held-out figure,
    # far above what shuffled labels reach.
    assert abs(model.fit_data["nested_auroc"] - held.trust_auroc) < 0.05
    assert 0.5 < model.fit_data["chance_auroc"] < 0.65 < model.fit_data["nested_auroc"]
    assert not model.at_chance
    assert held.flag_threshold is None and held.flagged_wrong == held.flagged_right == 0
    median = sorted(model.score(r.signals) for r in test)[100]
    flagged = report(test, model, None, flag_below=median)  # half the answers fall under it
    low = [not r.correct for r in test if model.score(r.signals) < median]
    assert (flagged.flagged_wrong, flagged.flagged_right) == (sum(low), len(low) - sum(low))
    assert flagged.flagged_wrong > 2 * flagged.flagged_right  # the low scores are mostly wrong
    assert report(train, model, {"data": "synthetic", "split": "fit", "n": 10}).held_out is False
    assert all(0.0 <= model.score(r.signals) <= 1.0 for r in test)
    # A probability at its own level: its mean near the share right, its Brier score well under
    # that of saying the share right for every answer; an answer scored far outside the data
    # it was fit on (as a model fit at another level scores) is not.
    scores = [model.score(r.signals) for r in test]
    assert held.mean_trust is not None and held.brier is not None
    assert held.mean_trust == pytest.approx(sum(scores) / len(scores))
    assert held.brier == pytest.approx(
        sum((v - r.correct) ** 2 for v, r in zip(scores, test, strict=True)) / len(test)
    )
    assert abs(held.mean_trust - held.right / held.n) < 0.1
    assert held.brier < 0.8 * held.brier_reference
    shifted = [dataclasses.replace(r, signals=_far(r.signals)) for r in test]
    far = report(shifted, model, None)
    assert far.brier is not None and far.brier > far.brier_reference
    assert report(test, None, None).brier is None
    store = TrustStore(tmp_path)
    saved = store.save(model)
    assert saved.version.startswith("trust-serve-balanced-")
    assert store.latest("m").weights == model.weights
    assert store.load(saved.version).score(test[0].signals) == model.score(test[0].signals)
    with pytest.raises(TrustModelNotFoundError, match="sparseguard trust fit"):
        store.latest("other-model")


def test_a_fit_on_labels_its_signals_do_not_predict_is_reported_as_chance(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rng = random.Random(3)
    sigs = [_signals(rng, True) for _ in range(120)]
    right = [rng.random() < 0.4 for _ in sigs]  # the labels ignore the signals
    with caplog.at_level(logging.WARNING, logger="sparse_engine.trust.model"):
        model = fit(sigs, right, model_id="m", level="dense", fit_data={})
    assert model.fit_data["nested_auroc"] <= model.fit_data["chance_auroc"] < 0.7
    assert "no better than chance (nested AUROC" in caplog.text and "at dense" in caplog.text
    assert model.at_chance
    # The gateway reports its low scores and, by default, does not act on them.
    calm = _stats([0.1, 0.1, 0.1, 0.1])  # no silence spike: low-score is the only reason
    with caplog.at_level(logging.WARNING, logger="services.gateway.trust"):
        judge = TrustJudge(TrustSettings(min_score=1.0), SignalSettings(), model)
    assert f"trust model {model.version} was no better than chance" in caplog.text
    reported = judge.assess(calm, "prompt", is_dense=True)
    assert reported.reasons == ("low-score",) and not reported.low and reported.action == "none"
    acting = TrustJudge(TrustSettings(min_score=1.0, act_on_chance=True), SignalSettings(), model)
    assert acting.assess(calm, "prompt", is_dense=True).low
    # A model fit before the figures were measured: unknown, acted on as before.
    older = replace(model, fit_data={"data": "halueval"})
    assert not older.at_chance
    judged = TrustJudge(TrustSettings(min_score=1.0), SignalSettings(), older)
    assert judged.assess(calm, "prompt", is_dense=True).low


def _far(signals: RequestSignals) -> RequestSignals:
    """The same answer with its confidence signal far outside the fit's range."""
    return dataclasses.replace(signals, mean_logprob=signals.mean_logprob - 20.0)


def test_answer_channel_probe_from_generation_and_teacher_forcing() -> None:
    engine = tiny_engine(cache=False)
    request = GenerationRequest(prompt="Once upon a time", max_new_tokens=5, ignore_eos=True)
    stats = engine.generate(request, Level.BALANCED).result()
    assert stats.signals is not None and stats.signals.answer_channels is not None
    width = int(engine.lm.model.config.intermediate_size)
    assert [len(row) for row in stats.signals.answer_channels] == [width] * engine.lm.num_layers
    sig = from_stats(stats, "Once upon a time")
    assert len(sig.probe) == width and len(stats.token_logprobs) == 5
    assert all(lp <= 0 for lp in stats.token_logprobs)
    messages = [{"role": "user", "content": "Once upon a time"}]
    probed = score_answer(engine, messages, stats.text, Level.BALANCED, measure_drift=False)
    assert from_stats(probed, "x").probe and len(probed.token_logprobs) == probed.completion_tokens
    model = fit(
        [sig, RequestSignals(mean_logprob=-3.0, probe=[0.0] * width)] * 5,
        [True, False] * 5,
        model_id="m",
        level="balanced",
        fit_data={},
        l2=0.1,
    )
    assert "probe" in candidates_of(model)
    with pytest.raises(ValueError, match="reads 128 values of probe but the answer has 3"):
        TrustModel.from_dict({**model.to_dict(), "groups": [probe_group(width)]}).score(
            RequestSignals(probe=[0.0] * 3)
        )


def test_a_signal_constant_in_the_fit_data_does_not_decide_a_new_answers_score() -> None:
    """Every fit answer ran to the token limit (as Gemma 3's dense QA answers did): a shorter
    answer later must be scored on the signals the fit learned from, not on its length over a
    zero spread (which gave logits of -2e4 and scores of exactly 0)."""
    train, test = _records(300, 0), _records(200, 1)
    for r in train:
        r.signals.length = 33
    model = fit(
        [r.signals for r in train],
        [r.correct for r in train],
        model_id="m",
        level="dense",
        fit_data={},
    )
    length_std = model.groups[0].std[FEATURES.index("log_length")]
    assert length_std == 1.0  # no spread: unscaled
    for r in test:
        r.signals.length = 5
    shorter = [model.score(r.signals) for r in test]
    assert min(shorter) > 1e-6 and max(shorter) < 1 - 1e-6
    assert report(test, model, None).trust_auroc > 0.9  # still read by its confidence


def test_fit_refuses_data_with_one_class() -> None:
    sigs = [RequestSignals(mean_logprob=-1.0)] * 5
    with pytest.raises(ValueError, match="both right and wrong"):
        fit(sigs, [True] * 5, model_id="m", level="balanced", fit_data={})


def test_report_names_the_best_baseline_and_the_direction_of_silence() -> None:
    records = _records(200, 2)
    for r in records:  # silence rises on wrong answers in this data
        r.signals.silence_per_layer = [0.0, 0.0, 0.1, 0.5 if not r.correct else 0.2]
    result = report(records, None, None)
    assert result.best_baseline == "mean_logprob" and result.best_baseline_auroc > 0.9
    assert result.silence_moves == "higher on wrong answers"
    assert result.trust_auroc == 1.0  # the rule-based score is 1 - late silence
    assert result.to_dict()["rows"][0]["name"] == "trust_score"


def test_silence_baseline_deviation_and_context_overlap() -> None:
    base = SilenceBaseline.of([[0.1, 0.0], [0.3, 0.0]])
    assert base.mean == (0.2, 0.0) and base.std == pytest.approx((0.1, 0.0))
    assert base.deviation([0.4, 0.0]) == pytest.approx(1.0)  # (2 + 0) / 2
    assert base.deviation([0.2, 0.05]) == pytest.approx(2.5)  # a still layer moved 0.05
    assert base.deviation([0.1]) == 0.0  # another layer count: no judgement
    assert context_overlap("Paris is the capital of France.", "Paris, France") == 1.0
    assert context_overlap("Paris is the capital.", "Berlin") == 0.0


def test_rolling_baseline_warms_up_then_flags_a_jump() -> None:
    baseline = RollingBaseline(span=20, min_requests=10)
    for i in range(9):
        baseline.update("balanced", 0.10 + 0.01 * (i % 2))
    assert baseline.z("balanced", 0.9) is None
    baseline.update("balanced", 0.10)
    z = baseline.z("balanced", 0.9)
    assert z is not None and z > 10
    assert baseline.z("aggressive", 0.9) is None  # levels are apart


def _stats(silence: list[float], confidence: float = 0.85, entropy: float = 0.5) -> GenerationStats:
    summary = SignalSummary(0.5, [0.5] * len(silence), confidence, 1.0, silence, [0.5], entropy)
    return GenerationStats(
        "Paris", "balanced", "v1", 10, 1, "stop", 0.1, 10.0, 100.0, 3.0, summary,
        token_logprobs=[-0.1], token_entropies=[0.2],
    )  # fmt: skip


def test_judge_reasons_and_header() -> None:
    judge = TrustJudge(TrustSettings(min_score=0.3), SignalSettings(), None)
    calm = judge.assess(_stats([0.1, 0.1, 0.1, 0.1]), "prompt", is_dense=False)
    assert calm.reasons == () and not calm.low and calm.action == "none"
    assert calm.header() == "0.900; action=none"
    spike = judge.assess(_stats([0.1, 0.9, 0.9, 0.9]), "prompt", is_dense=False)
    assert spike.reasons == ("silence-spike", "low-score") and spike.low
    assert spike.header() == "0.100; action=flag; reasons=silence-spike,low-score"
    gate = judge.assess(_stats([0.0] * 4, confidence=0.97, entropy=0.99), "p", is_dense=False)
    assert gate.reasons == ("gate-degraded", "monotonous-input") and not gate.low  # report only
    dense = judge.assess(_stats([0.0] * 4, confidence=1.0, entropy=0.99), "p", is_dense=True)
    assert dense.reasons == ()
    acted = spike.acted("retrieve", calm, passages=2)
    assert acted.header().endswith("first=0.100; passages=2") and acted.score == 0.9


def test_a_route_with_its_own_threshold_judges_the_score_by_it() -> None:
    own = TrustSettings(min_score=0.3, act_below={"/v1/chat/completions": 0.95})
    judge = TrustJudge(own, SignalSettings(), None)
    calm = _stats([0.1, 0.1, 0.1, 0.1])  # scores 0.9: above the flag threshold, under 0.95
    assert judge.assess(calm, "p", is_dense=False).reasons == ()
    chat = judge.assess(calm, "p", is_dense=False, route="/v1/chat/completions")
    assert chat.reasons == ("low-score",) and chat.low and chat.action == "flag"
    assert not judge.assess(calm, "p", is_dense=False, route="/v1/messages").low
    for bad in ({"/v1/chat/completion": 0.5}, {"/v1/messages": 1.5}):
        with pytest.raises(ValueError, match="act_below maps a route"):
            TrustSettings(act_below=bad)


def _chat(api: str = "openai", stream: bool = False) -> ChatInput:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q?"}]
    endpoint = "chat" if api == "openai" else "messages"
    return ChatInput(
        api,  # type: ignore[arg-type]
        "m",
        messages,
        16,
        0.0,
        1.0,
        (),
        stream,
        None,
        None,
        endpoint=endpoint,  # type: ignore[arg-type]
    )


def test_route_actions_and_fallback_prompts() -> None:
    settings = Settings(trust=TrustSettings(actions={"/v1/chat/completions": "retrieve"}))
    assert route_action(settings, _chat()) == "retrieve"
    assert route_action(settings, _chat("anthropic")) == "flag"  # the default
    assert route_action(settings, _chat(stream=True)) == "flag"  # already sent
    legacy = replace(_chat(), endpoint="completions")
    both = Settings(trust=TrustSettings(actions={"/v1/completions": "retrieve"}))
    assert route_action(both, legacy) == "flag"  # a raw prompt has no question to rework
    hits = [Hit(1, "wiki", "Paris", "Paris is the capital of France. " * 40, 1.0)]
    augmented = with_passages(_chat().messages, hits, max_chars=60)
    assert augmented[0] == {"role": "system", "content": "Be brief."}
    assert augmented[1]["content"].startswith("Use these passages")
    assert "[1] Paris: Paris is the capital" in augmented[1]["content"]
    assert augmented[1]["content"].endswith("\n\nQ?") and len(augmented[1]["content"]) < 200
    assert simplified(_chat().messages)[1]["content"] == "Q?\n\nAnswer in more basic language."


def candidates_of(model: TrustModel) -> set[str]:
    """Every group the fit could choose for this model's kind of answers."""
    sig = RequestSignals(probe=[0.0] * 128)
    values = group_vectors([sig], model.baseline, model.drift_default)
    return {name for names in candidates(values) for name in names}


def probe_group(width: int) -> dict[str, object]:
    return dataclasses.asdict(Group("probe", [0.0] * width, [1.0] * width))
