"""The trust model: L2-regularised logistic regression predicting that an answer is right, over
feature groups (`trust.features`): the scalar signals, the channel probe, per-head attention
(lookback share and entropy) and the residual stream at the readout's layers. Each group is
standardised; a wide group is reduced to its leading principal components (`trust.regression`).
Which groups (and which layer of the residual stream), how many components and how strong a
penalty are chosen by cross-validated AUROC on the fit data. Fit on graded answers (`fit`),
stored as a versioned JSON artefact like a calibration (`TrustStore`), applied per request
(`TrustModel.score`). A model is fit for one mode (serve: the engine's own answers; proxy: an
upstream's answers, teacher-forced) and one level."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from sparse_engine.jsonstore import JsonStore, stamped_version
from sparse_engine.sparsity.signals import LATE_BAND
from sparse_engine.trust.features import (
    FEATURES,
    RequestSignals,
    SilenceBaseline,
    readout_groups,
    scalar_features,
)
from sparse_engine.trust.regression import (
    SCALAR,
    Group,
    Vectors,
    chance_auroc,
    choose,
    fit_groups,
    folds,
    nested_auroc,
)

log = logging.getLogger(__name__)
MODEL_FORMAT = 2  # 2: feature groups with the readout
# serve: the model's own answers; proxy: another model's, teacher-forced; closed: the model's
# own answers to questions asked without their passage (a route that retrieves sees those).
MODES = ("serve", "proxy", "closed")
L2_GRID = (0.01, 0.03, 0.1, 0.3)
COMPONENTS = (8, 32)  # principal components kept of a wide group
ATTENTION = ("lookback", "attn_entropy")


class TrustModelNotFoundError(LookupError):
    """No trust model is stored for this model."""


@dataclass(slots=True)
class TrustModel:
    model_id: str
    level: str
    groups: list[Group]
    weights: list[float]
    bias: float
    baseline_mean: list[float]
    baseline_std: list[float]
    drift_default: float
    fit_data: dict[str, Any]
    mode: str = "serve"
    # The late band its late-silence feature was fit with.
    late_band: int = LATE_BAND
    # Per served level, scores below this flag an answer: the healthy-traffic thresholds
    # (`trust.flagging`), measured on answers at that level (sparser levels score lower), per
    # healthy kind and each kind's category; `flag_thresholds`: the lowest of a level's kinds
    # (the one threshold of a model fit before kinds). A level without one uses the gateway's
    # fixed minimum score.
    flag_thresholds: dict[str, float] = field(default_factory=dict)
    kind_thresholds: dict[str, dict[str, float]] = field(default_factory=dict)
    flag_categories: dict[str, str] = field(default_factory=dict)
    flag_fit: dict[str, dict[str, Any]] = field(default_factory=dict)  # per level
    format: int = MODEL_FORMAT
    created_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    version: str = ""

    @property
    def baseline(self) -> SilenceBaseline:
        return SilenceBaseline(tuple(self.baseline_mean), tuple(self.baseline_std))

    @property
    def at_chance(self) -> bool:
        """Whether its fit told right from wrong answers it did not see no better than chance
        (nested AUROC not above what shuffled labels reach). False for a model fit before both
        figures were measured: unknown, not at chance."""
        nested, chance = self.fit_data.get("nested_auroc"), self.fit_data.get("chance_auroc")
        return nested is not None and chance is not None and not nested > chance

    @property
    def group_names(self) -> list[str]:
        return [g.name for g in self.groups]

    def score(self, sig: RequestSignals) -> float:
        """Probability that the answer is right, in [0, 1]."""
        values = group_vectors([sig], self.baseline, self.drift_default, self.late_band)
        missing = [g.name for g in self.groups if g.name not in values]
        if missing:
            raise ValueError(
                f"the trust model reads {missing}, which this answer lacks (no readout: the "
                "request was served without one)"
            )
        return float(torch.sigmoid(self.logits(values))[0])

    def logits(self, values: Vectors) -> torch.Tensor:
        x = torch.cat([g.apply(values[g.name]) for g in self.groups], dim=1)
        return x @ torch.tensor(self.weights, dtype=x.dtype) + self.bias

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrustModel:
        if data.get("format") != MODEL_FORMAT:
            raise ValueError(
                f"trust model {data.get('version', '?')} was made by an older version (format "
                f"{data.get('format', 1)}, this one reads {MODEL_FORMAT}); fit a new one with "
                "`sparseguard trust fit`"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        model = cls(**{k: v for k, v in data.items() if k in names})
        model.groups = [Group(**g) for g in data["groups"]]
        return model


def group_vectors(
    signals: Sequence[RequestSignals],
    baseline: SilenceBaseline,
    drift_default: float,
    late_band: int = LATE_BAND,
) -> Vectors:
    """Each feature group over the answers, (answers, width) float64; a readout group only when
    every answer has a readout, the probe only when every answer has one of one width."""
    scalars = [scalar_features(s, baseline, drift_default, late_band) for s in signals]
    out: Vectors = {SCALAR: torch.tensor(scalars, dtype=torch.float64)}
    probes = [s.probe for s in signals]
    if all(probes) and len({len(p) for p in probes}) == 1:
        out["probe"] = torch.tensor(probes, dtype=torch.float64)
    readouts = [readout_groups(s.readout) for s in signals]
    for name in readouts[0] if all(readouts) else ():
        if all(name in r and r[name].shape == readouts[0][name].shape for r in readouts):
            out[name] = torch.stack([r[name] for r in readouts])
    return out


def candidates(values: Vectors) -> list[tuple[str, ...]]:
    """The group sets cross-validation chooses among: the scalar signals alone, with the
    channel probe, with per-head attention, and with attention and the residual stream (the
    answer's mean, or the last prompt token's) at one readout layer."""
    sets: list[tuple[str, ...]] = [(SCALAR,)]
    if "probe" in values:
        sets.append((SCALAR, "probe"))
    if all(a in values for a in ATTENTION):
        sets.append((SCALAR, *ATTENTION))
        for name in sorted(values):
            if name.startswith(("hidden.answer_mean.", "hidden.last_prompt.")):
                sets.append((SCALAR, *ATTENTION, name))
    return sets


def fit(
    signals: Sequence[RequestSignals],
    correct: Sequence[bool],
    *,
    model_id: str,
    level: str,
    fit_data: dict[str, Any],
    l2: float | None = None,
    late_band: int = LATE_BAND,
    mode: str = "serve",
) -> TrustModel:
    """Choose the groups, components and penalty by cross-validated AUROC (the penalty fixed
    when `l2` is given), then fit on all the data. Kept in `fit_data`: the chosen setting's
    cross-validated AUROC (optimistic by the choice among settings), the nested estimate of the
    whole procedure (`regression.nested_auroc`) and how high chance reaches
    (`regression.chance_auroc`), with a warning when the estimate is no higher. The
    one-standard-error rule (the simplest setting within one standard error of the best) was
    tried and did not carry better to other datasets (README)."""
    if len(set(correct)) < 2:
        raise ValueError("fitting needs both right and wrong answers in the data; use more items")
    if mode not in MODES:
        raise ValueError(f"unknown trust mode {mode!r}; choose one of {', '.join(MODES)}")
    baseline = SilenceBaseline.of([s.silence_per_layer for s in signals])
    drifts = [s.drift_kl for s in signals if s.drift_kl is not None]
    drift_default = sum(drifts) / len(drifts) if drifts else 0.0
    values = group_vectors(signals, baseline, drift_default, late_band)
    y = torch.tensor(correct, dtype=torch.float64)
    penalties = (l2,) if l2 is not None else L2_GRID

    def reduced(names: tuple[str, ...]) -> bool:  # whether the component count matters
        return any(n != SCALAR and values[n].shape[1] > COMPONENTS[0] for n in names)

    settings = [
        (names, k)
        for names in candidates(values)
        for k in COMPONENTS
        if k == COMPONENTS[0] or reduced(names)
    ]
    (names, k, penalty), cv = choose(values, y, settings, penalties)
    groups, weights, bias = fit_groups(values, y, names, k, penalty)
    nested = nested_auroc(values, y, settings, penalties)
    chance = chance_auroc(values, y, (names, k, penalty))
    log.info(
        "trust model: groups %s, %d components, l2 %s, cv AUROC %.3f, nested %.3f (chance "
        "reaches %.3f)",
        names, k, penalty, cv, nested, chance,
    )  # fmt: skip
    if not nested > chance:
        log.warning(
            "trust model at %s: the fit tells right from wrong answers it did not see no better "
            "than chance (nested AUROC %.3f; shuffled labels reach %.3f), so its low-score flags "
            "are close to random and the gateway reports them without acting on them "
            "(trust.act_on_chance); fit on more items (--n) or other data",
            level, nested, chance,
        )  # fmt: skip
    return TrustModel(
        model_id=model_id,
        level=level,
        groups=groups,
        weights=weights.tolist(),
        bias=bias,
        baseline_mean=list(baseline.mean),
        baseline_std=list(baseline.std),
        drift_default=drift_default,
        mode=mode,
        late_band=late_band,
        fit_data={
            **fit_data,
            "items": len(signals),
            "right": int(sum(correct)),
            "groups": list(names),
            "components": k,
            "l2": penalty,
            "cv_auroc": _rounded(cv),
            "nested_auroc": _rounded(nested),
            "chance_auroc": _rounded(chance),
            "features": len(FEATURES),
        },
    )


def out_of_fold(
    signals: Sequence[RequestSignals], correct: Sequence[bool], model: TrustModel
) -> list[float]:
    """Each answer's score from `model`'s setting (groups, components, penalty) refit on the
    other folds (`regression.folds`): scores like those of answers the fit never saw, for learning a
    threshold on the fit data itself."""
    values = group_vectors(signals, model.baseline, model.drift_default, model.late_band)
    y = torch.tensor(correct, dtype=torch.float64)
    k, penalty = model.fit_data["components"], model.fit_data["l2"]
    scores = torch.empty(len(y), dtype=torch.float64)
    for test, train in folds(len(y)):
        part = {n: values[n][train] for n in model.group_names}
        groups, w, b = fit_groups(part, y[train], model.group_names, k, penalty)
        x = torch.cat([g.apply(values[g.name][test]) for g in groups], dim=1)
        scores[test] = torch.sigmoid(x @ w + b)
    return scores.tolist()


def _rounded(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 4)


class TrustStore:
    """Trust models as `<root>/<version>.json` in a `JsonStore`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._files = JsonStore(root)

    def save(self, model: TrustModel) -> TrustModel:
        content = [model.weights, model.bias, model.fit_data]
        model.version = stamped_version(
            f"trust-{model.mode}-{model.level}", model.created_at, content
        )
        self._files.save(model.version, model.to_dict())
        return model

    def load(self, version: str) -> TrustModel:
        data = self._files.load(version)
        if data is None:
            raise TrustModelNotFoundError(f"no trust model {version!r} in {self.root}")
        return TrustModel.from_dict(data)

    def latest(self, model_id: str, level: str | None = None, mode: str = "serve") -> TrustModel:
        """The newest model of this format for `model_id` and `mode` (fit at `level`, when
        given); models of older formats are passed over."""
        models = []
        for data in self._files.all("trust-*.json"):
            try:
                models.append(TrustModel.from_dict(data))
            except ValueError as exc:
                log.debug("%s", exc)
        found = sorted(
            (
                m
                for m in models
                if m.model_id == model_id and m.mode == mode and level in (None, m.level)
            ),
            key=lambda m: (m.created_at, m.version),
        )
        if not found:
            command = "sparseguard trust fit" + (f" --mode {mode}" if mode != "serve" else "")
            raise TrustModelNotFoundError(
                f"no {mode}-mode trust model for {model_id}{f' at {level}' if level else ''} in "
                f"{self.root}; run `{command}`"
            )
        return found[-1]
