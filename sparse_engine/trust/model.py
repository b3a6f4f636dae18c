"""The trust model: L2-regularised logistic regression over the trust features, predicting that
an answer is right. Fit on graded answers (`fit`), stored as a versioned JSON artefact like a
calibration (`TrustStore`), applied per request (`TrustModel.score`)."""

from __future__ import annotations

import dataclasses
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
    RequestSignals,
    SilenceBaseline,
    feature_names,
    features,
)

L2_GRID = (0.3, 1.0, 3.0, 10.0, 30.0)  # penalties tried by cross-validation when none is given
FOLDS = 5
DEFAULT_L2 = 1.0


class TrustModelNotFoundError(LookupError):
    """No trust model is stored for this model."""


@dataclass(slots=True)
class TrustModel:
    model_id: str
    level: str
    feature_names: list[str]
    weights: list[float]
    bias: float
    mean: list[float]
    std: list[float]
    baseline_mean: list[float]
    baseline_std: list[float]
    drift_default: float
    probe_size: int
    fit_data: dict[str, Any]
    # The late band its late-silence feature was fit with; a model saved without one was fit
    # with the default.
    late_band: int = LATE_BAND
    # Per served level, scores below this flag an answer: the healthy-traffic threshold
    # (`trust.flagging`), measured on answers at that level (sparser levels score lower). A
    # level without one (or a model saved before them) uses the gateway's fixed minimum score.
    flag_thresholds: dict[str, float] = field(default_factory=dict)
    flag_fit: dict[str, dict[str, Any]] = field(default_factory=dict)  # per level
    created_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    version: str = ""

    @property
    def baseline(self) -> SilenceBaseline:
        return SilenceBaseline(tuple(self.baseline_mean), tuple(self.baseline_std))

    def score(self, sig: RequestSignals) -> float:
        """Probability that the answer is right, in [0, 1]."""
        return float(torch.sigmoid(self._logit(torch.tensor([self.vector(sig)]))[0]))

    def vector(self, sig: RequestSignals) -> list[float]:
        return features(sig, self.baseline, self.drift_default, self.probe_size, self.late_band)

    def _logit(self, x: torch.Tensor) -> torch.Tensor:
        z = (x.double() - torch.tensor(self.mean)) / torch.tensor(self.std)
        return z @ torch.tensor(self.weights, dtype=torch.float64) + self.bias

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrustModel:
        fields = dataclasses.fields(cls)
        optional = ("created_at", "late_band", "flag_thresholds", "flag_fit")
        missing = [f.name for f in fields if f.name not in data and f.name not in optional]
        if missing:
            raise ValueError(
                f"trust model {data.get('version', '?')} lacks {missing}: it was made by an "
                "older version; fit a new one with `sparseguard trust fit`"
            )
        data = _per_level_flags(data)
        model = cls(**{k: v for k, v in data.items() if k in {f.name for f in fields}})
        if model.feature_names != feature_names(model.probe_size):
            raise ValueError(
                f"trust model {model.version} uses features {model.feature_names}; this version "
                "reads others: fit a new one with `sparseguard trust fit`"
            )
        return model


def _per_level_flags(data: dict[str, Any]) -> dict[str, Any]:
    """A model saved with one `flag_threshold` (measured at its fit level) as per-level ones."""
    if "flag_threshold" not in data:
        return data
    found = {k: v for k, v in data.items() if k != "flag_threshold"}
    level, threshold = data.get("level", ""), data["flag_threshold"]
    found["flag_thresholds"] = {} if threshold is None else {level: threshold}
    found["flag_fit"] = {level: data["flag_fit"]} if data.get("flag_fit") else {}
    return found


def fit(
    signals: Sequence[RequestSignals],
    correct: Sequence[bool],
    *,
    model_id: str,
    level: str,
    fit_data: dict[str, Any],
    l2: float | None = None,
    late_band: int = LATE_BAND,
) -> TrustModel:
    """Standardise the features, then minimise the mean logistic loss plus l2 * |w|^2, with
    `l2` chosen by cross-validated AUROC over L2_GRID when not given."""
    if len(set(correct)) < 2:
        raise ValueError("fitting needs both right and wrong answers in the data; use more items")
    baseline = SilenceBaseline.of([s.silence_per_layer for s in signals])
    drifts = [s.drift_kl for s in signals if s.drift_kl is not None]
    drift_default = sum(drifts) / len(drifts) if drifts else 0.0
    probe_size = _probe_size(signals)
    x = torch.tensor(
        [features(s, baseline, drift_default, probe_size, late_band) for s in signals],
        dtype=torch.float64,
    )
    y = torch.tensor(correct, dtype=torch.float64)
    chosen, cv = (l2, None) if l2 is not None else _choose_l2(x, y)
    mean, std = x.mean(0), x.std(0, unbiased=False).clamp_min(1e-9)
    w, b = _logistic_regression((x - mean) / std, y, chosen)
    return TrustModel(
        model_id=model_id,
        level=level,
        feature_names=feature_names(probe_size),
        weights=w.tolist(),
        bias=b,
        mean=mean.tolist(),
        std=std.tolist(),
        baseline_mean=list(baseline.mean),
        baseline_std=list(baseline.std),
        drift_default=drift_default,
        probe_size=probe_size,
        late_band=late_band,
        fit_data={
            **fit_data,
            "items": len(signals),
            "right": int(sum(correct)),
            "l2": chosen,
            "cv_auroc": cv,
        },
    )


def _probe_size(signals: Sequence[RequestSignals]) -> int:
    sizes = {len(s.probe) for s in signals if s.probe}
    if len(sizes) > 1:
        raise ValueError(f"answers carry channel probes of different sizes {sorted(sizes)}")
    return sizes.pop() if sizes else 0


def _choose_l2(x: torch.Tensor, y: torch.Tensor) -> tuple[float, dict[str, float] | None]:
    """The penalty with the best mean AUROC over FOLDS interleaved folds (DEFAULT_L2 when some
    fold lacks a right or a wrong answer: too little data to choose)."""
    folds = [torch.arange(len(y))[k::FOLDS] for k in range(FOLDS)]
    scores = {}
    for l2 in L2_GRID:
        aucs = []
        for test in folds:
            train = torch.ones(len(y), dtype=torch.bool)
            train[test] = False
            mean, std = x[train].mean(0), x[train].std(0, unbiased=False).clamp_min(1e-9)
            w, b = _logistic_regression((x[train] - mean) / std, y[train], l2)
            logit = (x[test] - mean) / std @ w + b
            aucs.append(auroc((-logit).tolist(), (y[test] == 0).tolist()))
        if any(math.isnan(a) for a in aucs):
            return DEFAULT_L2, None
        scores[str(l2)] = sum(aucs) / len(aucs)
    best = max(L2_GRID, key=lambda l2: scores[str(l2)])
    return best, scores


def _logistic_regression(x: torch.Tensor, y: torch.Tensor, l2: float) -> tuple[torch.Tensor, float]:
    params = torch.zeros(x.shape[1] + 1, dtype=torch.float64, requires_grad=True)
    optimiser = torch.optim.LBFGS([params], max_iter=500, line_search_fn="strong_wolfe")

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
        model.version = stamped_version(f"trust-{model.level}", model.created_at, content)
        self._files.save(model.version, model.to_dict())
        return model

    def load(self, version: str) -> TrustModel:
        data = self._files.load(version)
        if data is None:
            raise TrustModelNotFoundError(f"no trust model {version!r} in {self.root}")
        return TrustModel.from_dict(data)

    def latest(self, model_id: str, level: str | None = None) -> TrustModel:
        """The newest model for `model_id` (fit at `level`, when given)."""
        models = map(TrustModel.from_dict, self._files.all("trust-*.json"))
        found = sorted(
            (m for m in models if m.model_id == model_id and level in (None, m.level)),
            key=lambda m: (m.created_at, m.version),
        )
        if not found:
            raise TrustModelNotFoundError(
                f"no trust model for {model_id}{f' at {level}' if level else ''} in {self.root}; "
                "run `sparseguard trust fit`"
            )
        return found[-1]
