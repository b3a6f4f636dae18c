"""A closed-form start for learned gates, and the measure of why gates fall short.

`fit_gates` sets every layer's gate to the best low-rank linear predictor of its channels'
activation magnitudes: a ridge least-squares fit of `|a_i| / t` (`a` the down-projection's
input, `t` the layer's magnitude at `quantile`) on the gate's features `[x ; LN(x)]`, cut to
`rank` by reduced-rank regression (the fit projected on the top principal directions of its
fitted values), scaled so that a gate opens (`g > 0.1`) where the predicted magnitude passes
`t`. It streams: only the features' moments are kept, never the activations.

`local_error` is the diagnostic: per layer, how much of the MLP's output the gate plan's
closed channels carry, against closing the same share of channels by magnitude (the threshold
sparsifier's rule, which sees the activations the gates must predict)."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from sparse_engine.model.arch import input_width, run_hooked
from sparse_engine.model.loader import LoadedModel
from sparse_engine.sparsity.gates import THRESHOLD, Gates, features

_SAMPLE_EVERY = 7  # thinning of the magnitudes kept for the layer's quantile


@dataclass(slots=True)
class _Moments:
    """Running sums of one layer's features `f` (width d) and magnitudes `y` (width m)."""

    f: torch.Tensor
    y: torch.Tensor
    ff: torch.Tensor
    fy: torch.Tensor
    n: int = 0
    sample: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def zeros(cls, d: int, m: int) -> _Moments:
        z = functools.partial(torch.zeros, dtype=torch.float64)
        return cls(z(d), z(m), z(d, d), z(d, m))

    def add(self, feats: torch.Tensor, mags: torch.Tensor) -> None:
        f, y = feats.double(), mags.double()
        self.n += f.shape[0]
        self.f = self.f + f.sum(0)
        self.y = self.y + y.sum(0)
        self.ff = self.ff + f.T @ f
        self.fy = self.fy + f.T @ y
        self.sample.append(mags.flatten()[::_SAMPLE_EVERY].float())


def _observe(lm: LoadedModel, batches: Iterable[torch.Tensor], sink: Any) -> None:
    """Run the dense model on `batches`, calling `sink(layer, mlp_input, down_input)`."""
    held: dict[int, torch.Tensor] = {}
    handles = []
    for part in lm.layers:
        mlp, down = part.get("mlp"), part.get("down")
        handles.append(
            mlp.register_forward_pre_hook(lambda m, a, i=part.index: held.update({i: a[0]}))
        )
        handles.append(
            down.register_forward_pre_hook(
                lambda m, a, i=part.index, d=down: sink(i, held.pop(i), a[0], d)
            )
        )
    run_hooked(lm.model, handles, batches)


def fit_gates(
    lm: LoadedModel,
    batches: Iterable[torch.Tensor],
    rank: int,
    quantile: float = 0.45,
    ridge: float = 1e-2,
    spread: float = 2.0,
) -> Gates:
    """Gates for every MLP of `lm` fitted on the dense model's activations over `batches`
    (token id tensors); `spread` is the logit standard deviation the predictions get."""
    hidden = int(lm.model.config.hidden_size)
    moments = [_Moments.zeros(2 * hidden, input_width(p.get("down"))) for p in lm.layers]

    def sink(layer: int, x: torch.Tensor, a: torch.Tensor, down: nn.Module) -> None:
        moments[layer].add(
            features(x.reshape(-1, x.shape[-1]).float()), a.reshape(-1, a.shape[-1]).abs()
        )

    _observe(lm, batches, sink)
    gates = Gates.for_layers(lm.layers, hidden, rank)
    cut = float(torch.logit(torch.tensor(THRESHOLD)))
    for layer, m in enumerate(moments):
        if m.n == 0:
            raise ValueError("no tokens to fit the gates on")
        t = torch.quantile(torch.cat(m.sample).double(), quantile).clamp_min(1e-12)
        mf, my = m.f / m.n, m.y / (m.n * t)
        cff = m.ff / m.n - torch.outer(mf, mf)
        cfy = (m.fy / m.n - torch.outer(mf, m.y / m.n)) / t
        eye = torch.eye(cff.shape[0], dtype=cff.dtype)
        b = torch.linalg.solve(cff + ridge * eye, cfy)  # features x channels
        fitted = b.T @ cff @ b  # covariance of the fitted magnitudes
        values, vectors = torch.linalg.eigh(fitted)
        v = vectors[:, -rank:]  # channels x rank: the top principal directions
        var = float(values[-rank:].clamp_min(0).sum()) / v.shape[0] + float(my.var())
        scale = spread / max(var, 1e-12) ** 0.5
        with torch.no_grad():
            gates.down[layer].copy_((b @ v).T)
            gates.up[layer].copy_(scale * v)
            centre = my - v @ (v.T @ (b.T @ mf))  # the predictions' offset
            gates.bias[layer].copy_(scale * (centre - 1.0) + cut)
    return gates


@dataclass(frozen=True, slots=True)
class LayerError:
    layer: int
    sparsity: float  # share of channels the gate plan closes
    gates: float  # share of the MLP output's energy the closed channels carry
    magnitude: float  # the same, closing the same share by magnitude

    def to_dict(self) -> dict[str, float | int]:
        return {
            "layer": self.layer,
            "sparsity": round(self.sparsity, 4),
            "gates": round(self.gates, 5),
            "magnitude": round(self.magnitude, 5),
        }


def local_error(
    lm: LoadedModel, gates: Gates, offset: float, batches: Iterable[torch.Tensor]
) -> list[LayerError]:
    """Per layer, on the dense model's activations over `batches`: the relative squared error
    of the MLP output when the gate plan closes channels, and when the same share of each
    layer's channels with the smallest magnitudes is closed instead."""
    sums = [[0, 0.0, 0.0, 0.0, 0.0] for _ in lm.layers]  # closed, count, gate, magnitude, total

    def sink(layer: int, x: torch.Tensor, a: torch.Tensor, down: nn.Module) -> None:
        a = a.reshape(-1, a.shape[-1])
        kept = gates.logits(layer, x.reshape(-1, x.shape[-1])) + offset > gates_cut
        closed = int((~kept).sum())
        flat = a.abs().flatten()
        k = min(closed, flat.numel() - 1)
        by_size = a.abs() > flat.kthvalue(k).values if k > 0 else torch.ones_like(kept)
        run = down.forward  # not `down(...)`: that would call this hook again
        zero = run(torch.zeros_like(a[:1]))
        full = run(a) - zero
        row = sums[layer]
        row[0] += closed
        row[1] += kept.numel()
        row[2] += float(((run(a * ~kept) - zero) ** 2).sum())
        row[3] += float(((run(a * ~by_size) - zero) ** 2).sum())
        row[4] += float((full**2).sum())

    gates_cut = float(torch.logit(torch.tensor(THRESHOLD)))
    _observe(lm, batches, sink)
    return [
        LayerError(i, r[0] / max(r[1], 1), r[2] / max(r[4], 1e-30), r[3] / max(r[4], 1e-30))
        for i, r in enumerate(sums)
    ]
