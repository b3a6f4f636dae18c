"""The trust model's regression: each feature group standardised and, when wide, reduced to its
leading principal components, under an L2-penalised logistic regression; the choice of a
setting (groups, components, penalty) by cross-validated AUROC; and a nested estimate of how
the whole procedure, that choice included, scores answers it never saw."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from sparse_engine.evaluation.ranking import auroc

SCALAR = "scalar"  # the named signals: standardised, never reduced
FOLDS = 5
PERMUTATIONS = 30  # shuffled labellings that measure what chance reaches
CHANCE_Z = 1.96  # chance's reach: the shuffled labels' mean AUROC plus this many deviations
NO_SPREAD = 1e-6  # a column with less spread than this on the fit data is a constant there
Vectors = dict[str, torch.Tensor]
Setting = tuple[tuple[str, ...], int, float]  # groups, components, penalty


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
        """Standardise `x`'s columns; a group wider than `components` is projected onto its
        leading principal components, each scaled to unit spread on `x` (the penalty then
        treats every input alike)."""
        mean, std = x.mean(0), scale(x.std(0, unbiased=False))
        if x.shape[1] <= components:
            return cls(name, mean.tolist(), std.tolist())
        z = (x - mean) / std
        axes = leading_axes(z, components)
        spread = scale((z @ axes.T).std(0, unbiased=False))
        return cls(name, mean.tolist(), std.tolist(), (axes / spread[:, None]).tolist())

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != len(self.mean):
            raise ValueError(
                f"the trust model reads {len(self.mean)} values of {self.name} but the answer "
                f"has {x.shape[-1]}: fit a trust model for this model with `sparseguard trust fit`"
            )
        std = scale(torch.tensor(self.std, dtype=x.dtype))  # as fit (models fit before too)
        z = (x - torch.tensor(self.mean, dtype=x.dtype)) / std
        return z if self.axes is None else z @ torch.tensor(self.axes, dtype=x.dtype).T


def scale(spread: torch.Tensor) -> torch.Tensor:
    """A column's scale: its spread on the fit data, or 1 where it has none. A constant there
    taught the fit nothing, and dividing by a floor instead (1e-6, twice) turned any other value
    on new data into a z-score of 1e10 to 1e12: Gemma 3's dense QA answers all ran to the token
    limit, so a shorter healthy answer got a logit down to -2.7e4 from its length alone
    (README)."""
    return torch.where(spread < NO_SPREAD, torch.ones_like(spread), spread)


def leading_axes(z: torch.Tensor, k: int) -> torch.Tensor:
    """The k leading principal axes (k, width) of centred rows `z`. With fewer rows than
    columns (a few hundred answers, thousands of channels) from the rows' Gram matrix: a small
    eigenproblem instead of a wide SVD (the SVDs were two thirds of the choice's time on
    Qwen2's 89 answers). Directions of no spread are left out."""
    if z.shape[0] >= z.shape[1]:
        right: torch.Tensor = torch.linalg.svd(z, full_matrices=False)[2]
        return right[:k]
    eigenvalues, vectors = torch.linalg.eigh(z @ z.T)
    eigenvalues, vectors = eigenvalues.flip(0)[:k], vectors.flip(1)[:, :k]
    kept = eigenvalues > eigenvalues[0].clamp(min=0) * 1e-12
    axes: torch.Tensor = (z.T @ vectors[:, kept]) / eigenvalues[kept].sqrt()
    return axes.T


def fit_groups(
    values: Vectors, y: torch.Tensor, names: Sequence[str], k: int, l2: float
) -> tuple[list[Group], torch.Tensor, float]:
    """Each group's transform on `values` and the logistic regression over them."""
    groups = [Group.fit(n, values[n], _components(n, k)) for n in names]
    x = torch.cat([g.apply(values[g.name]) for g in groups], dim=1)
    w, b = logistic_regression(x, y, l2)
    return groups, w, b


def _components(name: str, k: int) -> int:
    return 1 << 62 if name == SCALAR else k  # the scalar signals are never reduced


def logistic_regression(
    x: torch.Tensor,
    y: torch.Tensor,
    l2: float,
    start: torch.Tensor | None = None,
    steps: int = 100,
) -> tuple[torch.Tensor, float]:
    """Weights and bias minimising the mean log loss plus `l2` times the squared weights, by
    Newton's method (a convex problem of at most a hundred or so inputs: a few exact steps,
    each halved until the loss falls), from `start` (weights and bias) or zero."""
    a = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)
    ridge = torch.full((a.shape[1],), 2 * l2, dtype=x.dtype)
    ridge[-1] = 1e-9  # the bias is not penalised (a trace keeps the step defined)
    params = torch.zeros(a.shape[1], dtype=x.dtype) if start is None else start.clone()

    def loss(p: torch.Tensor) -> float:  # softplus: torch's BCE took milliseconds a call here
        logits = a @ p
        log_loss = (torch.nn.functional.softplus(logits) - y * logits).mean()
        return float(log_loss + l2 * p[:-1].pow(2).sum())

    current = loss(params)
    for _ in range(steps):
        prob = torch.sigmoid(a @ params)
        gradient = a.T @ (prob - y) / len(y) + ridge * params
        hessian = (a.T * (prob * (1 - prob))) @ a / len(y) + torch.diag(ridge)
        step = torch.linalg.solve(hessian, gradient)
        size = 1.0
        while size > 1e-6 and loss(params - size * step) > current:
            size /= 2
        params = params - size * step
        current = loss(params)
        if float((size * step).abs().max()) < 1e-10:
            break
    return params[:-1], float(params[-1])


def cross_validate(
    values: Vectors,
    y: torch.Tensor,
    settings: list[tuple[tuple[str, ...], int]],
    penalties: Sequence[float],
) -> list[tuple[Setting, float]]:
    """Mean AUROC over FOLDS interleaved folds of each setting and penalty (each group's
    transform fit once per fold and component count); NaN when a fold lacks a class: then the
    first setting, the scalar signals alone, wins."""
    aucs: dict[Setting, list[float]] = {}
    fitted: dict[tuple[int, str, int], Group] = {}  # each group once per fold and width
    for names, k in settings:
        for fold, (test, train) in enumerate(folds(len(y))):
            groups = []
            for n in names:
                key = (fold, n, min(_components(n, k), values[n].shape[1]))
                if key not in fitted:
                    fitted[key] = Group.fit(n, values[n][train], key[2])
                groups.append(fitted[key])
            x_train = torch.cat([g.apply(values[g.name][train]) for g in groups], dim=1)
            x_test = torch.cat([g.apply(values[g.name][test]) for g in groups], dim=1)
            start = None  # each penalty's fit starts from the stronger one's: a step or two
            for penalty in sorted(penalties, reverse=True):
                w, b = logistic_regression(x_train, y[train], penalty, start)
                start = torch.cat([w, torch.tensor([b], dtype=w.dtype)])
                wrong = (y[test] == 0).tolist()
                aucs.setdefault((names, k, penalty), []).append(
                    auroc((-(x_test @ w + b)).tolist(), wrong)
                )
    out = [(setting, sum(a) / len(a)) for setting, a in aucs.items()]
    if all(math.isnan(a) for _, a in out):
        return [(out[0][0], math.nan)]
    return [(setting, -math.inf if math.isnan(a) else a) for setting, a in out]


def choose(
    values: Vectors,
    y: torch.Tensor,
    settings: list[tuple[tuple[str, ...], int]],
    penalties: Sequence[float],
) -> tuple[Setting, float]:
    """The setting and penalty of the best cross-validated AUROC, and that AUROC (NaN when no
    fold had both classes)."""
    return max(cross_validate(values, y, settings, penalties), key=lambda item: item[1])


def nested_auroc(
    values: Vectors,
    y: torch.Tensor,
    settings: list[tuple[tuple[str, ...], int]],
    penalties: Sequence[float],
) -> float:
    """AUROC for a wrong answer of a model chosen (`choose`) and fit on the other folds alone,
    over each fold in turn (the mean of the folds', as in `cross_validate`: pooling the folds'
    scores would rank by each fold's intercept, which the fold's class shares move). The chosen
    setting's cross-validated AUROC is the best of dozens of noisy figures, so it overstates;
    this one scores the whole procedure, choice included, on answers it never saw."""
    areas = []
    for test, train in folds(len(y)):
        part = {n: v[train] for n, v in values.items()}
        (names, k, penalty), _ = choose(part, y[train], settings, penalties)
        groups, w, b = fit_groups(part, y[train], names, k, penalty)
        x = torch.cat([g.apply(values[g.name][test]) for g in groups], dim=1)
        areas.append(auroc((-(x @ w + b)).tolist(), (y[test] == 0).tolist()))
    kept = [a for a in areas if not math.isnan(a)]
    return sum(kept) / len(kept) if kept else math.nan


def chance_auroc(values: Vectors, y: torch.Tensor, setting: Setting, seed: int = 0) -> float:
    """How high `setting`'s cross-validated AUROC reaches on labels that mean nothing: its mean
    over PERMUTATIONS shuffles of `y` plus CHANCE_Z deviations. A cross-validated AUROC varies
    more than a held-out one of as many answers (measured on shuffled labels: a deviation of
    0.073 over 120 answers, where a held-out set's would be 0.054), so the band is measured,
    not taken from a formula."""
    names, k, penalty = setting
    split = []  # the transforms do not read the labels: one per fold serves every shuffle
    for test, train in folds(len(y)):
        groups = [Group.fit(n, values[n][train], _components(n, k)) for n in names]
        x = torch.cat([g.apply(values[g.name]) for g in groups], dim=1)
        split.append((x[train], x[test], train, test))
    generator = torch.Generator().manual_seed(seed)
    means = []
    for _ in range(PERMUTATIONS):
        shuffled = y[torch.randperm(len(y), generator=generator)]
        areas = []
        for x_train, x_test, train, test in split:
            w, b = logistic_regression(x_train, shuffled[train], penalty)
            areas.append(auroc((-(x_test @ w + b)).tolist(), (shuffled[test] == 0).tolist()))
        kept = [a for a in areas if not math.isnan(a)]
        if kept:
            means.append(sum(kept) / len(kept))
    if len(means) < 2:
        return math.nan
    spread = torch.tensor(means, dtype=torch.float64)
    return min(1.0, float(spread.mean() + CHANCE_Z * spread.std()))  # an AUROC ends at 1


def folds(n: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """FOLDS interleaved folds of n items: each fold's indices and the mask of the others."""
    for fold in range(FOLDS):
        test = torch.arange(n)[fold::FOLDS]
        train = torch.ones(n, dtype=torch.bool)
        train[test] = False
        yield test, train
