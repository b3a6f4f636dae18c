"""The trust decision of one answer, from the signals the engine already measured: a score in
[0, 1] (the trust model's probability that the answer is right, or 1 - late-layer silence
without a model) and the reasons that lowered it."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from services.config import Settings, SignalSettings, TrustSettings
from services.gateway.reasons import BaselineBook, trust_reasons
from services.telemetry.schema import REASON_LOW_SCORE
from sparse_engine.calibration.baseline import LevelBaseline
from sparse_engine.calibration.store import CalibrationStore
from sparse_engine.runtime.generation import GenerationStats
from sparse_engine.sparsity.plan import Level
from sparse_engine.sparsity.signals import prompt_category
from sparse_engine.trust.features import RequestSignals, from_stats, rule_score
from sparse_engine.trust.flagging import conformal_ceiling, flag_threshold
from sparse_engine.trust.model import TrustModel, TrustModelNotFoundError, TrustStore

log = logging.getLogger(__name__)

LEVELS = tuple(level.value for level in Level)


@dataclass(frozen=True, slots=True)
class Trust:
    score: float
    reasons: tuple[str, ...] = ()
    low: bool = False  # a reason that triggers the route's action fired
    action: str = "none"  # what was done: none | flag | retrieve | simplify
    late_silence: float = 0.0
    first_score: float | None = None  # the first answer's score, when it was regenerated
    passages: int = 0  # knowledge-base passages the regenerated prompt carried

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


@dataclass(frozen=True, slots=True)
class RouteModels:
    """The trust models of the mode that judges a route's first answers (`route_modes`): fit
    at each level, and `default`, fit at another level, for the rest."""

    mode: str
    default: TrustModel
    per_level: dict[str, TrustModel]


class TrustJudge:
    """Scores answers with the trust model fit at their level (else `model`, fit at another
    level, else the rule), or with their route's models (`routes`), and keeps the rolling
    silence baseline per level."""

    def __init__(
        self,
        cfg: TrustSettings,
        signals: SignalSettings,
        model: TrustModel | None,
        per_level: dict[str, TrustModel] | None = None,
        book: BaselineBook | None = None,
        routes: dict[str, RouteModels] | None = None,
    ) -> None:
        self.cfg = cfg
        self.signals = signals
        self.model = model
        self.per_level = per_level or {}
        self.routes = routes or {}
        self.baseline = RollingBaseline(cfg.baseline_span, cfg.baseline_min_requests)
        self.book = book or BaselineBook(None)
        for version in [] if cfg.act_on_chance else at_chance_versions(self):
            log.warning(
                "trust model %s was no better than chance on answers its fit did not see: its "
                "low scores are reported, not acted on (SPARSEGUARD_TRUST__ACT_ON_CHANCE=true "
                "acts on them)",
                version,
            )

    def assess(
        self,
        stats: GenerationStats,
        prompt_text: str,
        is_dense: bool,
        route: str | None = None,
        user_text: str | None = None,
        system: bool | None = None,
    ) -> Trust:
        """`route`: the path of a request's first answer; a route with its own models
        (`route_modes`) is scored by them, and one with its own threshold (`act_below`) judges
        the score by it instead of the healthy-chat flag threshold. `user_text`: the user's
        turns, which tell the request's category for the baseline tests (default: the whole
        `prompt_text`). `system`: whether a system prompt came with it (None: unknown)."""
        sig = from_stats(stats, prompt_text)
        late = sig.late_silence(self.signals.late_band)
        own_models = self.routes.get(route) if route is not None else None
        if own_models is not None:
            model: TrustModel | None = own_models.per_level.get(stats.level, own_models.default)
        else:
            model = self.per_level.get(stats.level, self.model)
        score = self._score(model, sig)
        z = self.baseline.z(stats.level, late)
        healthy = self.book.lookup(stats.calibration_version, stats.level)
        category = prompt_category(prompt_text if user_text is None else user_text)
        own = self.cfg.act_below.get(route) if route is not None else None
        if own is not None:
            flag_below = own
        else:
            kinds = healthy.kinds_of(category) if healthy is not None else None
            flag_below = self.flag_below(model, healthy, stats.level, kinds, system, category)
        reasons = trust_reasons(
            sig, score, self.signals, flag_below, is_dense, healthy, z, category, system
        )
        if stats.signals is not None:
            self.baseline.update(stats.level, late)
        acts_on = set(self.cfg.act_on)
        if model is not None and model.at_chance and not self.cfg.act_on_chance:
            acts_on.discard(REASON_LOW_SCORE)  # reported only: its fit found it at chance
        low = any(r in acts_on for r in reasons)
        action = "flag" if low else "none"
        return Trust(round(score, 4), reasons, low, action, late)

    def flag_below(
        self,
        model: TrustModel | None,
        healthy: LevelBaseline | None,
        level: str,
        kinds: list[str] | None = None,
        system: bool | None = None,
        category: str | None = None,
    ) -> float:
        """The model's healthy-traffic threshold at `level` (flag budget) for a request of
        `category`: the lowest of its kinds' (`trust.flagging`). Without a model the
        score is 1 - late-band silence, so the same budget applies to the baseline's late-band
        silence, on each of `kinds` (default all; each on the request's `system` side) as the
        reasons test it: the pooled sample flagged the kind with the quietest late layers
        (9-23 % of code, README). Else the fixed minimum score."""
        if model is not None:
            threshold = flag_threshold(model, level, category)
            return self.cfg.min_score if threshold is None else threshold
        late = healthy.get("late_silence") if healthy is not None else None
        if late is None:
            return self.cfg.min_score
        budget = self.cfg.flag_budget
        return 1.0 - max(
            conformal_ceiling(vs, budget) for vs in late.samples(budget, kinds, system)
        )

    def _score(self, model: TrustModel | None, sig: RequestSignals) -> float:
        if model is None:
            return rule_score(sig, self.signals.late_band)
        try:
            return model.score(sig)
        except ValueError as exc:  # a model that does not fit these answers: never a 500
            log.error("trust model %s: %s; scoring 1 - late-layer silence", model.version, exc)
            return rule_score(sig, self.signals.late_band)


def load_judge(settings: Settings, model_id: str, arrived: Sequence[TrustModel] = ()) -> TrustJudge:
    """The judge with the pinned trust model, the latest one for `model_id`, or none (then the
    score is 1 - late-layer silence, which predicts wrong answers no better than chance), and
    each route's models of its own mode (`route_modes`).
    `arrived`: trust models received on the control topic, weighed with the stored ones, so a
    gateway whose store could not keep one still serves it."""
    store = TrustStore(settings.trust_dir)
    book = BaselineBook(CalibrationStore(settings.calibrations_dir))  # the reasons' baselines
    routes = {}
    for route, route_mode in settings.trust.route_modes.items():
        default, at_levels = _models(store, model_id, arrived, route_mode)
        if default is None:
            log.warning(
                "no %s-mode trust model for %s in %s yet: %s is judged like the other routes "
                "until one is fit (`sparseguard trust fit --mode %s`)",
                route_mode, model_id, store.root, route, route_mode,
            )  # fmt: skip
        else:
            routes[route] = RouteModels(route_mode, default, at_levels)
    pinned = settings.trust.model_version
    if pinned:
        found = [m for m in arrived if m.version == pinned]
        pinned_model = found[0] if found else store.load(pinned)
        return TrustJudge(settings.trust, settings.signals, pinned_model, book=book, routes=routes)
    mode = settings.gateway.mode  # a proxy scores another model's answers: its own models
    model, per_level = _models(store, model_id, arrived, mode)
    if model is None:
        log.warning(
            "no %s-mode trust model for %s in %s yet: trust is the rule score (1 - late-layer "
            "silence) until one is fit (`sparseguard jobs trust-fit`, queued by `sparseguard "
            "up`) and arrives on the control topic",
            mode,
            model_id,
            store.root,
        )
    return TrustJudge(settings.trust, settings.signals, model, per_level, book, routes)


def _models(
    store: TrustStore, model_id: str, arrived: Sequence[TrustModel], mode: str
) -> tuple[TrustModel | None, dict[str, TrustModel]]:
    """The newest `mode` model of any level, and the newest fit at each level."""
    model = _newest(store, model_id, None, arrived, mode)
    per_level = {}
    for level in LEVELS if model is not None else ():
        found_at = _newest(store, model_id, level, arrived, mode)
        if found_at is not None:
            per_level[level] = found_at
            log.info(
                "%s-mode trust model for %s: %s (fit on %s)",
                mode, level, found_at.version, found_at.fit_data,
            )  # fmt: skip
    return model, per_level


def _newest(
    store: TrustStore,
    model_id: str,
    level: str | None,
    arrived: Sequence[TrustModel],
    mode: str,
) -> TrustModel | None:
    found = [
        m for m in arrived if m.model_id == model_id and m.mode == mode and level in (None, m.level)
    ]
    with contextlib.suppress(TrustModelNotFoundError):
        found.append(store.latest(model_id, level, mode))
    return max(found, key=lambda m: (m.created_at, m.version), default=None)


def reload_judge(
    settings: Settings, model_id: str, current: TrustJudge, arrived: Sequence[TrustModel]
) -> TrustJudge:
    """A new judge for `model_id` with the `arrived` trust models, to replace `current` for
    the requests that start afterwards. It keeps `current`'s rolling silence baseline, which
    describes the served model's answers, not the trust model."""
    judge = load_judge(settings, model_id, arrived)
    judge.baseline = current.baseline
    return judge


def at_chance_versions(judge: TrustJudge) -> list[str]:
    """The served trust models whose fit found them no better than chance, by version."""
    models = [judge.model, *judge.per_level.values()]
    for own in judge.routes.values():
        models += [own.default, *own.per_level.values()]
    return sorted({m.version for m in models if m is not None and m.at_chance})


def serving_versions(judge: TrustJudge) -> dict[str, str | None]:
    """The trust model version per level and as the default ("default"), then each route's
    own ("ROUTE LEVEL", "ROUTE default"); None: the rule."""
    versions = {level: m.version for level, m in judge.per_level.items()}
    for route, own in judge.routes.items():  # e.g. "/v1/chat/completions balanced"
        versions[f"{route} default"] = own.default.version
        versions.update({f"{route} {level}": m.version for level, m in own.per_level.items()})
    return {"default": judge.model.version if judge.model else None, **versions}
