"""The trust decision of one answer, from the signals the engine already measured: a score in
[0, 1] (the trust model's probability that the answer is right, or 1 - late-layer silence
without a model) and the reasons that lowered it."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

from services.config import Settings, TrustSettings
from sparse_engine.requests import GenerationStats
from sparse_engine.trust_model import TrustModel, TrustModelNotFoundError, TrustStore
from sparse_engine.trust_signals import RequestSignals, from_stats, rule_score

log = logging.getLogger(__name__)

SILENCE_SPIKE = "silence-spike"
GATE_DEGRADED = "gate-degraded"
MONOTONOUS_INPUT = "monotonous-input"
LOW_SCORE = "low-score"
REASONS = (SILENCE_SPIKE, GATE_DEGRADED, MONOTONOUS_INPUT, LOW_SCORE)
ACTIONS = ("none", "flag", "retrieve", "simplify")


@dataclass(frozen=True, slots=True)
class Trust:
    score: float
    reasons: tuple[str, ...] = ()
    low: bool = False  # a reason that triggers the route's action fired
    action: str = "none"  # what was done: none | flag | retrieve | simplify
    late_silence: float = 0.0
    first_score: float | None = None  # the first answer's score, when it was regenerated
    passages: int = 0  # knowledge-base passages the regenerated prompt carried

    @property
    def spike(self) -> bool:
        return SILENCE_SPIKE in self.reasons

    def header(self) -> str:
        """`X-IR-Trust`: `0.412; action=retrieve; reasons=silence-spike,low-score; first=0.21`."""
        parts = [f"{self.score:.3f}", f"action={self.action}"]
        if self.reasons:
            parts.append("reasons=" + ",".join(self.reasons))
        if self.first_score is not None:
            parts.append(f"first={self.first_score:.3f}")
        if self.action == "retrieve":
            parts.append(f"passages={self.passages}")
        return "; ".join(parts)

    def acted(self, action: str, final: Trust, passages: int = 0) -> Trust:
        """This (first) answer's decision, after `action` regenerated it into `final`."""
        return replace(
            self, score=final.score, action=action, first_score=self.score, passages=passages
        )


class RollingBaseline:
    """Per level, an exponentially weighted mean and variance of late-layer silence over
    recent requests; a request far above it is a spike even under the absolute threshold."""

    def __init__(self, span: int, min_requests: int) -> None:
        self.alpha = 2.0 / (span + 1)
        self.min_requests = min_requests
        self._state: dict[str, tuple[int, float, float]] = {}

    def z(self, level: str, value: float) -> float | None:
        """Standard deviations above the baseline; None while it is still warming up."""
        count, mean, var = self._state.get(level, (0, 0.0, 0.0))
        if count < self.min_requests:
            return None
        return (value - mean) / max(math.sqrt(var), 0.01)

    def update(self, level: str, value: float) -> None:
        count, mean, var = self._state.get(level, (0, value, 0.0))
        delta = value - mean
        mean += self.alpha * delta
        var = (1 - self.alpha) * (var + self.alpha * delta * delta)
        self._state[level] = (count + 1, mean, var)


class TrustJudge:
    def __init__(self, cfg: TrustSettings, model: TrustModel | None) -> None:
        self.cfg = cfg
        self.model = model
        self.baseline = RollingBaseline(cfg.baseline_span, cfg.baseline_min_requests)

    def assess(self, stats: GenerationStats, prompt_text: str, is_dense: bool) -> Trust:
        sig = from_stats(stats, prompt_text)
        score = self.model.score(sig) if self.model else rule_score(sig)
        reasons = self._reasons(sig, score, stats.level, is_dense)
        if stats.signals is not None:
            self.baseline.update(stats.level, sig.late_silence)
        low = any(r in self.cfg.act_on for r in reasons)
        action = "flag" if low else "none"
        return Trust(round(score, 4), reasons, low, action, sig.late_silence)

    def _reasons(
        self, sig: RequestSignals, score: float, level: str, is_dense: bool
    ) -> tuple[str, ...]:
        cfg, found = self.cfg, []
        z = self.baseline.z(level, sig.late_silence)
        if sig.late_silence > cfg.spike_silence or (z is not None and z > cfg.spike_z):
            found.append(SILENCE_SPIKE)
        if not is_dense:  # a dense pass has no sparsifier whose gate could degrade
            if sig.gate_entropy > cfg.gate_uniform_entropy:
                found.append(GATE_DEGRADED)
            if sig.gate_confidence > cfg.monotonous_confidence:
                found.append(MONOTONOUS_INPUT)
        if score < cfg.min_score:
            found.append(LOW_SCORE)
        return tuple(found)


def load_judge(settings: Settings, model_id: str) -> TrustJudge:
    """The judge with the pinned trust model, the latest one for `model_id`, or none (then the
    score is 1 - late-layer silence, which predicts wrong answers no better than chance)."""
    store = TrustStore(settings.trust_dir)
    pinned = settings.trust.model_version
    try:
        model = store.load(pinned) if pinned else store.latest(model_id)
    except TrustModelNotFoundError as exc:
        if pinned:
            raise
        log.warning("%s; trust falls back to 1 - late-layer silence", exc)
        model = None
    if model is not None:
        log.info("trust model %s (fit on %s)", model.version, model.fit_data)
    return TrustJudge(settings.trust, model)
