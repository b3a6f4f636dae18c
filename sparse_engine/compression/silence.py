"""Silent channels: capture per-channel activation statistics with hooks, mark silent and
bias-like channels by a configurable rule, and hold the result as a `SilenceMap`.

Two kinds of channel per layer: "mlp", the FFN intermediate act(gate) * up (the input of the
down projection), and "attn", the concatenated head outputs (the input of the output
projection). Every token position of every sample counts as one observation of a channel.
Memory is bounded: five float64 vectors per (layer, kind), plus one float32 vector per sample
(the sample's mean |a| per channel) that the HTML heat map plots over the samples.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
from torch import nn

from sparse_engine.model.arch import LayerParts, run_hooked

KIND_ROLES = {"mlp": "down", "attn": "o"}  # channel kind -> projection whose input it is
ChannelSite = tuple[int, str]  # (layer, kind): where a set of channels lives


@dataclass(frozen=True, slots=True)
class SilenceRule:
    """Silent: (mean |a| < max_mean and std < max_std) or |a| < near_zero_eps in at least
    `near_zero_share` of positions. Critical channels divide every threshold by
    `critical_factor` (the share's complement too: 0.95 -> 0.995). Bias-like: |signed mean| at
    least `bias_ratio` x the layer's median mean |a|, with std / |signed mean| < `bias_cv`."""

    max_mean: float = 1e-5
    max_std: float = 1e-6
    near_zero_eps: float = 1e-4
    near_zero_share: float = 0.95
    critical_factor: float = 10.0
    protect_last: int = 3
    bias_ratio: float = 20.0
    bias_cv: float = 0.1
    max_change_pct: float = 0.5

    def strict(self) -> SilenceRule:
        f = self.critical_factor
        share = 1.0 - (1.0 - self.near_zero_share) / f
        return SilenceRule(self.max_mean / f, self.max_std / f, self.near_zero_eps / f, share)


@dataclass(slots=True)
class ChannelStats:
    """Running statistics of one (layer, kind); `near_zero_strict` counts at eps / factor."""

    positions: int
    abs_sum: torch.Tensor
    sq_sum: torch.Tensor
    signed_sum: torch.Tensor
    near_zero: torch.Tensor
    near_zero_strict: torch.Tensor
    shift: torch.Tensor | None = None  # first sample's per-channel mean, for a stable std
    series: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def empty(cls, width: int) -> ChannelStats:
        a, b, c, d, e = (torch.zeros(width, dtype=torch.float64) for _ in range(5))
        return cls(0, a, b, c, d, e)

    def add(self, rows: torch.Tensor, rule: SilenceRule) -> None:
        """Fold in one sample's (positions, channels) activations; sums accumulate in float64."""
        rows = rows.float()
        magnitude = rows.abs()
        abs_sum = magnitude.sum(0, dtype=torch.float64)
        self.positions += rows.shape[0]
        self.abs_sum += abs_sum
        if self.shift is None:
            self.shift = rows.mean(0)
        centred = rows - self.shift  # shifted sums: near-constant channels keep their tiny std
        self.sq_sum += (centred * centred).sum(0, dtype=torch.float64)
        self.signed_sum += rows.sum(0, dtype=torch.float64)
        self.near_zero += (magnitude < rule.near_zero_eps).sum(0)
        self.near_zero_strict += (magnitude < rule.near_zero_eps / rule.critical_factor).sum(0)
        self.series.append((abs_sum / max(rows.shape[0], 1)).float())

    @property
    def mean(self) -> torch.Tensor:
        return self.abs_sum / max(self.positions, 1)

    @property
    def signed_mean(self) -> torch.Tensor:
        return self.signed_sum / max(self.positions, 1)

    @property
    def std(self) -> torch.Tensor:
        n = max(self.positions, 1)
        shift = self.shift.double() if self.shift is not None else 0.0
        offset = self.signed_mean - shift
        return (self.sq_sum / n - offset.pow(2)).clamp_min(0.0).sqrt()

    def share(self, strict: bool = False) -> torch.Tensor:
        counts = self.near_zero_strict if strict else self.near_zero
        return counts / max(self.positions, 1)

    def series_matrix(self) -> torch.Tensor:
        """(samples, channels) mean |a| per sample."""
        return torch.stack(self.series) if self.series else torch.zeros(0, self.abs_sum.numel())


@dataclass(slots=True)
class Capture:
    units: dict[ChannelSite, ChannelStats] = field(default_factory=dict)
    samples: int = 0
    tokens: int = 0

    def series_by_unit(self) -> dict[ChannelSite, torch.Tensor]:
        return {unit: stats.series_matrix() for unit, stats in self.units.items()}


def capture(
    model: nn.Module,
    layers: list[LayerParts],
    batches: Iterable[torch.Tensor],
    rule: SilenceRule,
    progress: Callable[[int], None] | None = None,
) -> Capture:
    """Run `batches` (token ids, shape (1, T)) and gather per-channel statistics."""
    result = Capture()
    handles = [
        part.get(role).register_forward_pre_hook(_capture_hook(result, (part.index, kind), rule))
        for part in layers
        for kind, role in KIND_ROLES.items()
    ]

    def count(ids: torch.Tensor) -> None:
        result.samples += 1
        result.tokens += ids.numel()
        if progress is not None:
            progress(ids.numel())

    run_hooked(model, handles, batches, count)
    return result


def _capture_hook(result: Capture, unit: ChannelSite, rule: SilenceRule) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        rows = args[0].detach().reshape(-1, args[0].shape[-1])
        stats = result.units.get(unit)
        if stats is None:
            stats = result.units[unit] = ChannelStats.empty(rows.shape[-1])
        stats.add(rows, rule)

    return hook


def flag_silent(stats: ChannelStats, rule: SilenceRule, critical: Iterable[int] = ()) -> list[int]:
    """Channels the rule marks silent; `critical` channels are held to `rule.strict()`."""
    flags = _silent_mask(stats.mean, stats.std, stats.share(), rule)
    chosen = sorted(set(critical))
    if chosen:
        strict = _silent_mask(stats.mean, stats.std, stats.share(strict=True), rule.strict())
        flags[chosen] = strict[chosen]
    return [int(i) for i in torch.nonzero(flags).flatten()]


def _silent_mask(
    mean: torch.Tensor, std: torch.Tensor, share: torch.Tensor, rule: SilenceRule
) -> torch.Tensor:
    constant_zero = (mean < rule.max_mean) & (std < rule.max_std)
    return constant_zero | (share >= rule.near_zero_share)


def flag_bias_like(stats: ChannelStats, rule: SilenceRule) -> list[int]:
    """High-magnitude, near-constant channels: they act as a bias (fold them, never prune)."""
    signed = stats.signed_mean.abs()
    floor = rule.bias_ratio * float(stats.mean.median())
    flags = (signed > floor) & (signed > rule.max_mean) & (stats.std < rule.bias_cv * signed)
    return [int(i) for i in torch.nonzero(flags).flatten()]


def protected_layers(num_layers: int, rule: SilenceRule) -> list[int]:
    return list(range(max(num_layers - rule.protect_last, 0), num_layers))


# ---- the artefact -------------------------------------------------------------------------


@dataclass(slots=True)
class ChannelSet:
    """One (layer, kind): per-channel statistics and the channels each verdict selects.
    `flagged` is what the rule marked (protected layers included); `silent` is what ablation
    confirmed and may be removed (never in protected layers)."""

    size: int
    silent: list[int]
    flagged: list[int]
    bias_like: list[int]
    mean: list[float]
    std: list[float]
    near_zero_share: list[float]
    signed_mean: list[float]

    @classmethod
    def from_stats(
        cls, stats: ChannelStats, flagged: list[int], bias_like: list[int]
    ) -> ChannelSet:
        return cls(
            size=stats.abs_sum.numel(),
            silent=[],
            flagged=flagged,
            bias_like=bias_like,
            mean=_rounded(stats.mean),
            std=_rounded(stats.std),
            near_zero_share=_rounded(stats.share()),
            signed_mean=_rounded(stats.signed_mean),
        )


@dataclass(slots=True)
class LayerMap:
    layer: int
    mlp: ChannelSet
    attn: ChannelSet

    def kinds(self) -> dict[str, ChannelSet]:
        return {"mlp": self.mlp, "attn": self.attn}


@dataclass(slots=True)
class Ablation:
    metric: str
    dense: float
    ablated: float
    change_pct: float
    accepted: bool
    candidates: list[dict[str, Any]]  # [{"layer", "mlp": [...], "attn": [...]}]


@dataclass(slots=True)
class SilenceMap:
    model_id: str
    weights_sha256: str
    corpus: str
    samples: int
    tokens: int
    rule: SilenceRule
    protected_layers: list[int]
    critical: list[dict[str, Any]]  # [{"layer", "kind", "channel"}]
    layers: list[LayerMap]
    ablation: Ablation

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["rule"] = asdict(self.rule)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SilenceMap:
        names = {f.name for f in fields(SilenceRule)}
        layers = [
            LayerMap(d["layer"], ChannelSet(**d["mlp"]), ChannelSet(**d["attn"]))
            for d in data["layers"]
        ]
        values = {k: data[k] for k in ("model_id", "weights_sha256", "corpus", "samples")}
        return cls(
            **values,
            tokens=int(data.get("tokens", 0)),
            rule=SilenceRule(**{k: v for k, v in data["rule"].items() if k in names}),
            protected_layers=list(data["protected_layers"]),
            critical=list(data.get("critical", [])),
            layers=layers,
            ablation=Ablation(**data["ablation"]),
        )

    def silent_channels(self) -> dict[ChannelSite, list[int]]:
        return {(lm.layer, k): cs.silent for lm in self.layers for k, cs in lm.kinds().items()}


def _rounded(values: torch.Tensor, digits: int = 4) -> list[float]:
    return [float(f"{v:.{digits}g}") for v in values.tolist()]


def diff(a: SilenceMap, b: SilenceMap) -> dict[str, Any]:
    """Per layer and kind, channels silent in `a` but active in `b`, and the reverse."""
    silent_a, silent_b = a.silent_channels(), b.silent_channels()
    layers = []
    for unit in sorted(set(silent_a) | set(silent_b)):
        only_a = sorted(set(silent_a.get(unit, [])) - set(silent_b.get(unit, [])))
        only_b = sorted(set(silent_b.get(unit, [])) - set(silent_a.get(unit, [])))
        if only_a or only_b:
            layers.append({"layer": unit[0], "kind": unit[1], "only_a": only_a, "only_b": only_b})
    return {"a": a.corpus, "b": b.corpus, "layers": layers}
