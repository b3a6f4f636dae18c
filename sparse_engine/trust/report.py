"""The trust evaluation report: AUROC for predicting a wrong answer, for the trust score (as
shipped: lower trust should mean wrong), for each raw signal and for the baselines (each in its
better direction, which the report names)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sparse_engine.evaluation.ranking import auroc
from sparse_engine.sparsity.signals import LATE_BAND
from sparse_engine.trust.evaluate import QARecord
from sparse_engine.trust.features import RequestSignals, SilenceBaseline, rule_score
from sparse_engine.trust.model import TrustModel

Reader = Callable[[RequestSignals], float]
_SIGNALS: dict[str, Reader] = {  # late_silence is read with the report's late band
    "gate_confidence": lambda s: s.gate_confidence,
    "gate_entropy": lambda s: s.gate_entropy,
    "drift_kl": lambda s: s.drift_kl or 0.0,
    "sparsity_ratio": lambda s: s.sparsity_ratio,
    "activation_stability": lambda s: s.activation_stability,
    "context_overlap": lambda s: s.context_overlap,
    "max_entropy": lambda s: s.max_entropy,
}
# What a detector must beat (read off the record: "in_passage" needs the item's passage).
BASELINES: dict[str, Callable[[QARecord], float]] = {
    "answer_length": lambda r: float(r.signals.length),
    "in_passage": lambda r: float(r.in_passage),
    "mean_logprob": lambda r: r.signals.mean_logprob,
    "min_logprob": lambda r: r.signals.min_logprob,
    "mean_entropy": lambda r: r.signals.mean_entropy,
}


@dataclass(frozen=True, slots=True)
class SignalRow:
    name: str
    kind: str  # trust | rule | signal | baseline
    auroc: float
    direction: str


@dataclass(frozen=True, slots=True)
class TrustReport:
    n: int
    right: int
    mean_f1: float
    trust_model: str | None
    held_out: bool | None
    rows: list[SignalRow]
    silence_wrong: float
    silence_right: float
    # The score under which the gateway flags these answers (`trust.flagging`), and how many
    # wrong and right answers fall under it; None without a model or a threshold.
    flag_threshold: float | None = None
    flagged_wrong: int = 0
    flagged_right: int = 0
    # Is the model's score a probability of a right answer at this level? Its mean against the
    # share right, and its Brier score against that of saying the share right for every answer
    # (share * (1 - share)); None without a model.
    mean_trust: float | None = None
    brier: float | None = None

    @property
    def brier_reference(self) -> float:
        share = self.right / self.n if self.n else 0.0
        return share * (1 - share)

    @property
    def trust_auroc(self) -> float:
        return next(r.auroc for r in self.rows if r.kind == "trust")

    @property
    def best_baseline(self) -> str:
        return max((r for r in self.rows if r.kind == "baseline"), key=lambda r: r.auroc).name

    @property
    def best_baseline_auroc(self) -> float:
        return max(r.auroc for r in self.rows if r.kind == "baseline")

    @property
    def silence_moves(self) -> str:
        if self.silence_wrong == self.silence_right:
            return "no difference"
        return (
            "higher on wrong answers"
            if self.silence_wrong > self.silence_right
            else ("lower on wrong answers")
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "trust_auroc": self.trust_auroc,
            "best_baseline": self.best_baseline,
            "best_baseline_auroc": self.best_baseline_auroc,
            "silence_moves": self.silence_moves,
            "brier_reference": self.brier_reference,
        }


def report(
    records: Sequence[QARecord],
    model: TrustModel | None,
    data: dict[str, Any] | None,
    late_band: int = LATE_BAND,
    flag_below: float | None = None,
) -> TrustReport:
    wrong = [not r.correct for r in records]
    signals = [r.signals for r in records]
    baseline = (
        model.baseline if model else SilenceBaseline.of([s.silence_per_layer for s in signals])
    )

    def rule(s: RequestSignals) -> float:
        return rule_score(s, late_band)

    trust: Reader = model.score if model else rule
    scores = [trust(s) for s in signals]
    flagged = [flag_below is not None and score < flag_below for score in scores]
    rows = [SignalRow("trust_score", "trust", auroc([1 - v for v in scores], wrong), "lower")]
    if model:
        rows.append(_row("rule_score", "rule", [1 - rule(s) for s in signals], wrong))
    late = [s.late_silence(late_band) for s in signals]
    deviation = [baseline.deviation(s.silence_per_layer) for s in signals]
    rows.append(_row("silence_deviation", "signal", deviation, wrong))
    rows.append(_row("late_silence", "signal", late, wrong))
    rows += [_row(n, "signal", list(map(f, signals)), wrong) for n, f in _SIGNALS.items()]
    rows += [_row(n, "baseline", list(map(f, records)), wrong) for n, f in BASELINES.items()]
    late_wrong = [v for v, w in zip(late, wrong, strict=True) if w]
    late_right = [v for v, w in zip(late, wrong, strict=True) if not w]
    return TrustReport(
        n=len(records),
        right=sum(r.correct for r in records),
        mean_f1=sum(r.f1 for r in records) / max(len(records), 1),
        trust_model=model.version if model else None,
        held_out=_held_out(model, data) if model and data else None,
        rows=rows,
        silence_wrong=_mean(late_wrong),
        silence_right=_mean(late_right),
        flag_threshold=flag_below,
        flagged_wrong=sum(f and w for f, w in zip(flagged, wrong, strict=True)),
        flagged_right=sum(f and not w for f, w in zip(flagged, wrong, strict=True)),
        mean_trust=_mean(scores) if model else None,
        brier=_mean([(v - (not w)) ** 2 for v, w in zip(scores, wrong, strict=True)])
        if model
        else None,
    )


def _row(name: str, kind: str, values: list[float], wrong: list[bool]) -> SignalRow:
    """AUROC in the signal's better direction, and that direction."""
    a = auroc(values, wrong)
    return SignalRow(name, kind, max(a, 1 - a), "higher" if a >= 0.5 else "lower")


def _held_out(model: TrustModel, data: dict[str, Any]) -> bool:
    """Evaluated on another set, or on the other half of the same one (`trust.qa.qa_sample`)."""
    fitted = model.fit_data
    return bool(fitted.get("data") != data["data"] or fitted.get("split") != data["split"])


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0
