"""The trust model: L2-regularised logistic regression predicting that an answer is right, over
feature groups (`trust.features`): the scalar signals, the channel probe, per-head attention
(lookback share and entropy) and the residual stream at the readout's layers. Each group is
standardised; a wide group is reduced to its leading principal components. Which groups (and
which layer of the residual stream), how many components and how strong a penalty are chosen by
cross-validated AUROC on the fit data. Fit on graded answers (`fit`), stored as a versioned JSON
artefact like a calibration (`TrustStore`), applied per request (`TrustModel.score`). A model
is fit for one mode (serve: the engine's own answers; proxy: an upstream's answers,
teacher-forced) and one level."""

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

from sparse_engine.evaluation.ranking import auroc
from sparse_engine.jsonstore import JsonStore, stamped_version
from sparse_engine.sparsity.signals import LATE_BAND
from sparse_engine.trust.features import (
    FEATURES,
    RequestSignals,
    SilenceBaseline,
    readout_groups,
    scalar_features,
)

log = logging.getLogger(__name__)
MODEL_FORMAT = 2  # 2: feature groups with the readout
# serve: the model's own answers; proxy: another model's, teacher-forced; closed: the model's
# own answers to questions asked without their passage (a route that retrieves sees those).
MODES = ("serve", "proxy", "closed")
L2_GRID = (0.01, 0.03, 0.1, 0.3)
COMPONENTS = (8, 32)  # principal components kept of a wide group
SCALAR = "scalar"  # the named signals: standardised, never reduced
FOLDS = 5
DEFAULT_L2 = 0.1
ATTENTION = ("lookback", "attn_entropy")
NO_SPREAD = 1e-6  # a column with less spread than this on the fit data is a constant there
Vectors = dict[str, torch.Tensor]


class TrustModelNotFoundError(LookupError):
    """No trust model is stored for this model."""


@dataclass(slots=True)
class Group:
    """One feature group's transform: standardise, then project onto `axes` (k, width), the
    leading principal components of the standardised fit data (None: keep every value)."""

    name: str
    mean: list[float]
    std: list[float]
    axes: list[list[float]] | None = None

    @classmethod
    def fit(cls, name: str, x: torch.Tensor, components: int) -> Group:
        mean, std = x.mean(0), scale(x.std(0, unbiased=False))
        if x.shape[1] <= components:
            return cls(name, mean.tolist(), std.tolist())
        _, _, v = torch.linalg.svd((x - mean) / std, full_matrices=False)
        return cls(name, mean.tolist(), std.tolist(), v[:components].tolist())

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != len(self.mean):
            raise ValueError(
                f"the trust model reads {len(self.mean)} values of {self.name} but the answer "
                f"has {x.shape[-1]}: fit a trust model for this model with `sparseguard trust fit`"
            )
        std = scale(torch.tensor(self.std, dtype=x.dtype))  # as fit (models fit before too)
        z = (x - torch.tensor(self.mean, dtype=x.dtype)) / std
        return z if self.axes is None else z @ torch.tensor(self.axes, dtype=x.dtype).T


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
    when `l2` is given), then fit on all the data. The chosen setting's cross-validated AUROC is
    kept in `fit_data` (optimistic by the choice among settings; a held-out evaluation is the
    honest figure). The one-standard-error rule (the simplest setting within one standard
    error of the best) was tried and did not carry better to other datasets (README)."""
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
    scored = _cross_validate(values, y, settings, penalties)
    (names, k, penalty), cv = max(scored, key=lambda item: item[1])
    groups, weights, bias = _fit_groups(values, y, names, k, penalty)
    log.info("trust model: groups %s, %d components, l2 %s, cv AUROC %.3f", names, k, penalty, cv)
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
            "cv_auroc": None if math.isnan(cv) else round(cv, 4),
            "features": len(FEATURES),
        },
    )


def out_of_fold(
    signals: Sequence[RequestSignals], correct: Sequence[bool], model: TrustModel
) -> list[float]:
    """Each answer's score from `model`'s setting (groups, components, penalty) refit on the
    other FOLDS - 1 folds: scores like those of answers the fit never saw, for learning a
    threshold on the fit data itself."""
    values = group_vectors(signals, model.baseline, model.drift_default, model.late_band)
    y = torch.tensor(correct, dtype=torch.float64)
    k, penalty = model.fit_data["components"], model.fit_data["l2"]
    scores = torch.empty(len(y), dtype=torch.float64)
    for fold in range(FOLDS):
        test = torch.arange(len(y))[fold::FOLDS]
        train = torch.ones(len(y), dtype=torch.bool)
        train[test] = False
        part = {n: values[n][train] for n in model.group_names}
        groups, w, b = _fit_groups(part, y[train], model.group_names, k, penalty)
        x = torch.cat([g.apply(values[g.name][test]) for g in groups], dim=1)
        scores[test] = torch.sigmoid(x @ w + b)
    return scores.tolist()


Setting = tuple[tuple[str, ...], int, float]  # groups, components, penalty


def _cross_validate(
    values: Vectors,
    y: torch.Tensor,
    settings: list[tuple[tuple[str, ...], int]],
    penalties: Sequence[float],
) -> list[tuple[Setting, float]]:
    """Mean AUROC over FOLDS interleaved folds of each setting and penalty (the transforms fit
    once per fold and setting); NaN when a fold lacks a class: then the first setting, the
    scalar signals alone, wins."""
    folds = [torch.arange(len(y))[k::FOLDS] for k in range(FOLDS)]
    aucs: dict[Setting, list[float]] = {}
    for names, k in settings:
        for test in folds:
            train = torch.ones(len(y), dtype=torch.bool)
            train[test] = False
            groups = _transforms({n: values[n][train] for n in names}, names, k)
            x_train = torch.cat([g.apply(values[g.name][train]) for g in groups], dim=1)
            x_test = torch.cat([g.apply(values[g.name][test]) for g in groups], dim=1)
            for penalty in penalties:
                w, b = _logistic_regression(x_train, y[train], penalty)
                wrong = (y[test] == 0).tolist()
                aucs.setdefault((names, k, penalty), []).append(
                    auroc((-(x_test @ w + b)).tolist(), wrong)
                )
    out = [(setting, sum(a) / len(a)) for setting, a in aucs.items()]
    if all(math.isnan(a) for _, a in out):
        return [(out[0][0], math.nan)]
    return [(setting, -math.inf if math.isnan(a) else a) for setting, a in out]


def scale(spread: torch.Tensor) -> torch.Tensor:
    """A column's scale: its spread on the fit data, or 1 where it has none. A constant there
    taught the fit nothing, and dividing by a floor instead (1e-6, twice) turned any other value
    on new data into a z-score of 1e10 to 1e12: Gemma 3's dense QA answers all ran to the token
    limit, so a shorter healthy answer got a logit down to -2.7e4 from its length alone
    (README)."""
    return torch.where(spread < NO_SPREAD, torch.ones_like(spread), spread)


def _fit_groups(
    values: Vectors, y: torch.Tensor, names: Sequence[str], k: int, l2: float
) -> tuple[list[Group], torch.Tensor, float]:
    groups = _transforms(values, names, k)
    x = torch.cat([g.apply(values[g.name]) for g in groups], dim=1)
    w, b = _logistic_regression(x, y, l2)
    return groups, w, b


def _transforms(values: Vectors, names: Sequence[str], k: int) -> list[Group]:
    """Each group's transform, scaled so that every projected column has unit spread on
    `values` (the penalty then treats every input alike)."""
    groups = [Group.fit(n, values[n], k if n != SCALAR else values[n].shape[1]) for n in names]
    x = torch.cat([g.apply(values[g.name]) for g in groups], dim=1)
    spread = scale(x.std(0, unbiased=False))
    start = 0
    for g in groups:
        width = len(g.axes) if g.axes is not None else len(g.mean)
        part = spread[start : start + width]
        if g.axes is not None:
            g.axes = (torch.tensor(g.axes, dtype=torch.float64) / part[:, None]).tolist()
        else:
            g.std = (torch.tensor(g.std, dtype=torch.float64) * part).tolist()
        start += width
    return groups


def _logistic_regression(x: torch.Tensor, y: torch.Tensor, l2: float) -> tuple[torch.Tensor, float]:
    params = torch.zeros(x.shape[1] + 1, dtype=torch.float64, requires_grad=True)
    optimiser = torch.optim.LBFGS([params], max_iter=300, line_search_fn="strong_wolfe")

    def loss_fn() -> torch.Tensor:
        optimiser.zero_grad()
        logits = x @ params[:-1] + params[-1]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y)
        loss = loss + l2 * params[:-1].pow(2).sum()
        loss.backward()  # type: ignore[no-untyped-call]
        return loss

    with torch.enable_grad():
        optimiser.step(loss_fn)  # type: ignore[no-untyped-call]
    found = params.detach()
    return found[:-1], float(found[-1])


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
