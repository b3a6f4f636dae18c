"""The settings sections that judge requests (SPARSEGUARD_SIGNALS__*: every signal threshold
and band; SPARSEGUARD_TRUST__*: when an answer counts as low trust and what is done about it),
and the refusal of thresholds under their old names. Part of `services.config`, which
re-exports them; like it, imports no other service package and no ML library."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

# Written out for the same reason as services.config.DEFAULT_MODEL; tests/test_signal_settings.py
# holds them equal to services.telemetry.schema's REASON_*.
DEFAULT_ACT_ON = ("silence-spike", "low-score")

# Thresholds that moved to SignalSettings from the trust and jobs sections: old name -> name
# there. The golden drift budgets were renamed when their unit changed (points of the per-item
# metric against external references, no longer corpus BLEU against dense answers).
MOVED_TO_SIGNALS = {
    **{n: n for n in ("spike_silence", "spike_z", "gate_uniform_entropy", "monotonous_confidence")},
    "drift_budget_bleu": "drift_budget",
    "drift_recalibrate_bleu": "drift_recalibrate",
}
RENAMED_SIGNALS = frozenset(old for old, new in MOVED_TO_SIGNALS.items() if old != new)


def refuse_moved(data: Any, names: Iterable[str] = MOVED_TO_SIGNALS) -> Any:
    """Refuse a moved threshold under its old section (SPARSEGUARD_TRUST__SPIKE_SILENCE) or
    name: unknown keys are ignored, so it would otherwise be dropped without a word."""
    moved = sorted(set(data) & set(names)) if isinstance(data, dict) else []
    if moved:
        new = ", ".join(f"SPARSEGUARD_SIGNALS__{MOVED_TO_SIGNALS[n].upper()}" for n in moved)
        why = "moved or was renamed (golden drift is in points of its metric, no longer BLEU)"
        why = why if RENAMED_SIGNALS & set(moved) else "moved to the signals section"
        raise ValueError(f"{', '.join(moved)} {why}: set {new}")
    return data


def refuse_renamed(data: Any) -> Any:
    """Refuse a signal under its old name (SPARSEGUARD_SIGNALS__DRIFT_BUDGET_BLEU)."""
    return refuse_moved(data, RENAMED_SIGNALS)


Band = tuple[float, float]
Threshold = float | Band
# Golden drift limits in points of the per-item metric. PROVISIONAL, not yet measured on the
# real model (see the golden-check helper's report); sparseguard golden check measures them.
DRIFT_BUDGET = 3.0
DRIFT_RECALIBRATE = 5.0


class SignalSettings(BaseModel):
    """Every signal threshold and band (the published defaults), read by the gateway's trust
    reasons, the aggregator's fold, the alert rules, the dashboards and the golden-set check,
    so that changing one here moves all of them (SPARSEGUARD_SIGNALS__SPIKE_SILENCE=0.85)."""

    _renamed = model_validator(mode="before")(refuse_renamed)

    late_band: int = Field(3, ge=1)  # last layers whose mean silence is the spike signal
    spike_silence: float = Field(0.80, ge=0.0, le=1.0)  # late-band silence above this: a spike
    spike_z: float = Field(4.0, gt=0.0)  # or this many std above the level's rolling baseline
    gate_band: Band = (0.75, 0.92)  # healthy gate confidence [low, high]
    gate_uniform_entropy: float = Field(0.95, ge=0.0, le=1.0)  # gate degraded above this
    monotonous_confidence: float = Field(0.95, ge=0.0, le=1.0)  # monotonous input above this
    sparsity_target_default: float = Field(0.60, ge=0.0, le=1.0)  # when no target is known
    drift_kl_24h: float = Field(1.2, ge=0.0)  # 24 h mean KL(dense || sparse) above this alerts
    cache_hit_min: float = Field(0.7, ge=0.0, le=1.0)  # prefix cache hit rate below this alerts
    # Tests against the calibration's healthy baseline (the numbers above are the fallbacks
    # where none exists): each per-request reason fires on at most this share of healthy
    # requests (a conformal p-value below it) ...
    reason_budget: float = Field(0.01, gt=0.0, lt=1.0)
    # ... with this confidence over the draw of the baseline's sample, where each kind's
    # sample is large enough (230 requests a kind for 1 % at 90 %); 0: on average only.
    reason_confidence: float = Field(0.9, ge=0.0, lt=1.0)
    # ... and a window alert needs its mean beyond the baseline's tolerance by this many
    # standard errors of a mean of the window's n requests (one-sided).
    alert_z: float = Field(4.0, gt=0.0)
    spike_share_effect: float = Field(0.04, ge=0.0, le=1.0)  # spike share over the budget
    # A hit-rate drop worth an alert, as a share of the key's trailing 24 h rate (an absolute
    # 0.10 was more than a workload whose prompts share a short system prompt ever reached).
    cache_drop_effect: float = Field(0.25, ge=0.0, le=1.0)
    # A window whose requests vary less than this share of healthy traffic's spread (the upper
    # confidence bound of its sd, alert_z deep, over the baseline's per-request sd; the
    # largest over signals) is one input repeated (SignalSpreadCollapsed).
    spread_floor: float = Field(0.15, gt=0.0, lt=1.0)
    # Golden-set drift, in points (0-100) of the per-item metric (token F1 or chrF): a check is
    # over budget when its 95 % interval's lower bound is above drift_budget; a 24 h mean of
    # lower bounds above drift_recalibrate queues a recalibration. Measured: README.
    drift_budget: float = Field(DRIFT_BUDGET, ge=0.0)
    drift_recalibrate: float = Field(DRIFT_RECALIBRATE, ge=0.0)

    @field_validator("gate_band")
    @classmethod
    def _ordered(cls, band: Band) -> Band:
        if band[0] > band[1]:
            raise ValueError(f"gate_band needs low <= high, got {list(band)}")
        return band

    def as_thresholds(self) -> dict[str, Threshold]:
        """The signals by name, for `alerts.rules.load_rules(path, signals=...)` (the alert
        library does not import the settings)."""
        return {
            name: value if isinstance(value, tuple) else float(value)
            for name, value in self.model_dump().items()
        }


TrustAction = Literal["retrieve", "simplify", "flag"]
TrustMode = Literal["serve", "proxy", "closed"]  # sparse_engine.trust.model.MODES


ROUTE_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/messages")


class TrustSettings(BaseModel):
    """Per-request trust: when an answer counts as low trust, and what is done about it."""

    _moved = model_validator(mode="before")(refuse_moved)

    # Below this score (the trust model's probability that the answer is right) trust is low.
    # On held-out HaluEval, 0.3 flagged 17 % of answers, right half as often as the rest.
    min_score: float = Field(0.3, ge=0.0, le=1.0)
    # The fallback above; a trust model scored on healthy answers at fit time flags instead
    # below the score that this share of a kind's healthy answers fall under.
    flag_budget: float = Field(0.05, gt=0.0, lt=1.0)
    # ... with this confidence over the draw of the healthy answers (0: on average only; on
    # average, 100 a kind flagged 8-12 % of held-out chat, code and prose, README).
    flag_confidence: float = Field(0.9, ge=0.0, lt=1.0)
    # Healthy answers of each kind scored for those thresholds (the baseline half of each).
    flag_requests: int = Field(100, ge=1)
    flag_kinds: list[str] = Field(
        default_factory=lambda: ["chat", "qa", "code", "prose"], min_length=1
    )
    baseline_span: int = Field(200, ge=2)  # requests in the rolling baseline's EWMA
    baseline_min_requests: int = Field(30, ge=1)  # before this, no deviation is judged
    # Reasons that trigger the action; any other reason is reported only.
    act_on: list[str] = Field(default_factory=lambda: list(DEFAULT_ACT_ON))
    # Act on `low-score` from a trust model whose fit found it no better than chance on
    # answers it did not see (`TrustModel.at_chance`); by default its low scores are reported
    # only (of eight per-level HaluEval fits, the seven it warned about held out at 0.48-0.60).
    act_on_chance: bool = False
    default_action: TrustAction = "flag"
    actions: dict[str, TrustAction] = Field(default_factory=dict)  # per route path
    # Per route path, the trust score under which that route's answers are low (`low-score`),
    # in place of the healthy-chat flag threshold: a route that retrieves sees other traffic
    # (`sparseguard eval retrieval --budget B` learns one on a QA set's fit half).
    act_below: dict[str, float] = Field(default_factory=dict)
    # Per route path, the mode of the trust models that judge that route's first answers in
    # place of the gateway's own mode: "closed" for a route whose questions come without their
    # passage (`sparseguard trust fit --mode closed`); a regenerated answer is judged as before.
    route_modes: dict[str, TrustMode] = Field(default_factory=dict)
    retrieve_passages: int = Field(3, ge=1, le=20)
    passage_chars: int = Field(600, ge=50)  # each passage is cut to this many characters
    model_version: str | None = None  # pin a trust model; default: the latest for the model
    dir: Path | None = None  # trust models and evaluation records; default: <home>/trust

    @field_validator("route_modes")
    @classmethod
    def _route_modes(cls, value: dict[str, str]) -> dict[str, str]:
        unknown = [route for route in value if route not in ROUTE_PATHS]
        if unknown:
            raise ValueError(
                f"route_modes maps a route ({', '.join(ROUTE_PATHS)}) to a trust mode, e.g. "
                f'{{"/v1/chat/completions": "closed"}}; got {unknown[0]!r}'
            )
        return value

    @field_validator("act_below")
    @classmethod
    def _route_scores(cls, value: dict[str, float]) -> dict[str, float]:
        for route, score in value.items():
            if route not in ROUTE_PATHS or not 0.0 <= score <= 1.0:
                raise ValueError(
                    f"act_below maps a route ({', '.join(ROUTE_PATHS)}) to a trust score in "
                    f'[0, 1], e.g. {{"/v1/chat/completions": 0.35}}; got {route!r}: {score}'
                )
        return value
