"""The quantisation-against-silence survey: each weight type, with and without the lift,
against float32 on one model. Per variant: the silent-channel set captured on the calibration
samples (against float32's), the damage to the lifted channels' reading weights, and on
evaluation tokens each level's realised sparsity and perplexity change over float32 dense.

The lifted channels are those the silence rule flags in float32 on the calibration samples,
plus, with `quiet_share` > 0, that share of each site's channels with the lowest float32
mean |a|: a stated stand-in for a model in which the rule flags few or none.
Variants whose quantised weights are bit-identical to an earlier one's share its figures
(`same_as`): the forward passes would be the same."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from sparse_engine.compression.quant_silence import (
    LIFT,
    Channels,
    Damage,
    damage,
    fingerprint,
    quantised,
    quantiser,
)
from sparse_engine.compression.silence import ChannelSite, SilenceRule, capture, flag_silent
from sparse_engine.evaluation.perplexity import PerplexityResult, perplexity
from sparse_engine.model.arch import LayerParts
from sparse_engine.model.loader import LoadedModel
from sparse_engine.sparsity.plan import SparsityPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LevelResult:
    """One level under one weight type: realised sparsity on the evaluation tokens,
    perplexity, and its change over float32 dense in percent with one paired standard error."""

    sparsity: float
    perplexity: float
    change_pct: float
    change_se_pct: float


@dataclass(frozen=True, slots=True)
class VariantResult:
    weights: str
    lift: bool
    silent: SetChange
    damage: Damage
    levels: dict[str, LevelResult]
    same_as: str | None = None

    @property
    def name(self) -> str:
        return f"{self.weights}+lift" if self.lift else self.weights


@dataclass(frozen=True, slots=True)
class SurveyInputs:
    """Calibration samples (silence capture), evaluation tokens (perplexity, sparsity) and
    the plans to measure by level name, "dense" among them."""

    batches: list[torch.Tensor]
    eval_tokens: torch.Tensor
    plans: dict[str, SparsityPlan]
    rule: SilenceRule = field(default_factory=SilenceRule)
    factor: float = LIFT
    quiet_share: float = 0.0


@dataclass(frozen=True, slots=True)
class Reference:
    """float32's silent set and dense perplexity, which every variant is compared with, and
    the channels the lift variants lift."""

    silent: Channels
    dense: PerplexityResult
    lifted: Channels


@dataclass(frozen=True, slots=True)
class SetChange:
    """A silent set against the reference: its size, Jaccard index, channels silent in the
    reference and active now (woke), and active in the reference and silent now (quieted)."""

    silent: int
    jaccard: float
    woke: int
    quieted: int


def compare(reference: Channels, other: Channels) -> SetChange:
    a = {(site, c) for site, cols in reference.items() for c in cols}
    b = {(site, c) for site, cols in other.items() for c in cols}
    union = a | b
    jaccard = len(a & b) / len(union) if union else 1.0
    return SetChange(len(b), jaccard, len(a - b), len(b - a))


def silence_of(
    model: nn.Module, layers: list[LayerParts], batches: list[torch.Tensor], rule: SilenceRule
) -> tuple[Channels, dict[ChannelSite, torch.Tensor]]:
    """The channels `rule` flags silent on `batches` in every layer (no ablation, no protected
    layers: this compares sets and removes nothing), and each site's mean |a| per channel."""
    units = sorted(capture(model, layers, batches, rule).units.items())
    return {s: flag_silent(u, rule) for s, u in units}, {s: u.mean for s, u in units}


def quietest(means: dict[ChannelSite, torch.Tensor], share: float) -> Channels:
    """The `share` of each site's channels with the lowest mean |a| (none at share 0)."""
    return {
        site: sorted(mean.argsort()[: math.ceil(share * mean.numel())].tolist())
        for site, mean in means.items()
    }


def joined(a: Channels, b: Channels) -> Channels:
    return {site: sorted(set(a.get(site, [])) | set(b.get(site, []))) for site in {*a, *b}}


def variants(weight_types: list[str]) -> list[tuple[str, bool]]:
    """(weight type, lift) pairs: float32 first (the reference), each type without the lift
    and then with it."""
    names = ["float32", *(w for w in dict.fromkeys(weight_types) if w != "float32")]
    return [(name, lift) for name in names for lift in (False, True)]


def survey(
    lm: LoadedModel,
    inputs: SurveyInputs,
    weight_types: list[str],
    progress: Callable[[str], None] | None = None,
) -> list[VariantResult]:
    """Every variant of `variants(weight_types)` measured on `lm`, whose weights are the same
    after as before."""
    if "dense" not in inputs.plans:
        raise ValueError("the survey needs the dense plan: perplexity changes are over dense")
    pairs = variants(weight_types)
    for weights, _ in pairs:
        quantiser(weights)  # an unknown type fails before any work
    run = _Survey(lm, inputs)
    results = []
    for weights, lift in pairs:
        if progress is not None:
            progress(f"{weights}{'+lift' if lift else ''}")
        results.append(run.variant(weights, lift))
        log.info("%s: %s", results[-1].name, results[-1])
    return results


class _Survey:
    """One survey's state: the reference (set by the first, float32, variant) and the
    results by weights fingerprint."""

    def __init__(self, lm: LoadedModel, inputs: SurveyInputs) -> None:
        self.lm, self.inputs = lm, inputs
        self.reference: Reference | None = None
        self.seen: dict[str, VariantResult] = {}

    def variant(self, weights: str, lift: bool) -> VariantResult:
        lifted = self.reference.lifted if lift and self.reference is not None else None
        layers = self.lm.layers
        with quantised(layers, quantiser(weights), lifted, self.inputs.factor) as originals:
            key = fingerprint(layers)
            earlier = self.seen.get(key)
            if earlier is not None:
                return dataclasses.replace(
                    earlier, weights=weights, lift=lift, same_as=earlier.name
                )
            silent, means, runs = self._measure()
            ref = self.reference = self.reference or self._reference(silent, means, runs)
            harm = damage(layers, originals, ref.lifted)
        result = VariantResult(
            weights, lift, compare(ref.silent, silent), harm, _levels(runs, ref.dense)
        )
        self.seen[key] = result
        return result

    def _measure(
        self,
    ) -> tuple[Channels, dict[ChannelSite, torch.Tensor], dict[str, PerplexityResult]]:
        lm, inputs = self.lm, self.inputs
        silent, means = silence_of(lm.model, lm.layers, inputs.batches, inputs.rule)
        runs = {
            name: perplexity(lm.model, lm.layers, inputs.eval_tokens, plan, prefix=lm.bos_prefix)
            for name, plan in inputs.plans.items()
        }
        return silent, means, runs

    def _reference(
        self,
        silent: Channels,
        means: dict[ChannelSite, torch.Tensor],
        runs: dict[str, PerplexityResult],
    ) -> Reference:
        lifted = joined(silent, quietest(means, self.inputs.quiet_share))
        log.info("lifted channels: %d", sum(len(c) for c in lifted.values()))
        return Reference(silent, runs["dense"], lifted)


def _levels(runs: dict[str, PerplexityResult], dense: PerplexityResult) -> dict[str, LevelResult]:
    levels = {}
    for name, run in runs.items():
        change = run.change_pct(dense)
        se = run.change_pct(dense, z=1.0) - change
        levels[name] = LevelResult(run.sparsity, run.perplexity, change, se)
    return levels
