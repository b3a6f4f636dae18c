"""The three fine-tuning aids of the learned-sparsity method (`../shared/docs/mission.md`).

- **L1 gradient re-weighting (L1-GRW)**: `lambda * sign(w) * exp(-alpha * |w|)` is added to
  each trained weight's gradient after the backward pass, so small weights are pulled to zero
  harder than large ones. It is added to the gradient, as the method states, not applied as a
  decoupled update: with Adam the term is therefore normalised with the loss gradient.
- **Head KL**: per layer, the mean over heads, query positions and batch of
  KL(head's attention distribution || the heads' mean distribution). SDPA returns no
  probabilities, so attention runs eagerly inside `head_kl_terms(...)` (as `read_out` does)
  and a forward hook on each attention module reads the probabilities, gradient attached.
- **Online silence re-calibration**: `SilenceTracker` re-captures the MLP channels' statistics
  on a small sample with the project's silence rule (`compression.silence`), rebuilds the
  plan-A `ChannelMask` (protected layers left out) and reports which channels woke up (silent
  before, active now) or went quiet (active before, silent now).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from sparse_engine.compression.silence import SilenceRule, capture, flag_silent, protected_layers
from sparse_engine.model.arch import LayerParts
from sparse_engine.sparsity.masking import ChannelMask

PROB_FLOOR = 1e-12  # keeps log(0) out of the KL: a masked position has probability exactly 0
LayerChannels = dict[int, list[int]]  # layer -> FFN intermediate channels


# ---- L1 gradient re-weighting -------------------------------------------------------------


def l1_grw_gradient(weight: torch.Tensor, lam: float, alpha: float) -> torch.Tensor:
    """`lam * sign(w) * exp(-alpha * |w|)`, the term L1-GRW adds to the weight's gradient."""
    w = weight.detach()
    return lam * torch.sign(w) * torch.exp(-alpha * w.abs())


def add_l1_grw(params: Iterable[nn.Parameter], lam: float, alpha: float) -> None:
    """Add the L1-GRW term to each parameter's gradient, in place (after `backward()`)."""
    for param in params:
        term = l1_grw_gradient(param, lam, alpha)
        if param.grad is None:
            param.grad = term
        else:
            param.grad.add_(term)


def tiny_share(params: Iterable[torch.Tensor], eps: float = 1e-4) -> float:
    """Share of the weights, over all `params` together, with |w| < eps."""
    tiny, total = 0, 0
    with torch.no_grad():
        for param in params:
            tiny += int((param.abs() < eps).sum())
            total += param.numel()
    return tiny / max(total, 1)


# ---- head KL ------------------------------------------------------------------------------


def head_kl(probs: torch.Tensor) -> torch.Tensor:
    """Mean KL(p_h || mean_h p_h) of attention probabilities shaped (batch, heads, queries,
    keys): 0 when every head attends alike, larger the more they disagree."""
    p = probs.float()
    mean = p.mean(dim=1, keepdim=True)
    log_ratio = p.clamp_min(PROB_FLOOR).log() - mean.clamp_min(PROB_FLOOR).log()
    return (p * log_ratio).sum(dim=-1).mean()


@contextmanager
def head_kl_terms(model: nn.Module, layers: Sequence[LayerParts]) -> Iterator[list[torch.Tensor]]:
    """Inside the block, each forward call appends one head-KL term per layer to the yielded
    list. Attention runs eagerly meanwhile; the previous implementation is restored on exit."""
    config = getattr(model, "config", None)
    previous = getattr(config, "_attn_implementation", None) or "sdpa"
    terms: list[torch.Tensor] = []
    handles: list[RemovableHandle] = []
    model.set_attn_implementation("eager")  # type: ignore[operator]
    try:
        for part in layers:
            handles.append(part.get("attn").register_forward_hook(_kl_hook(terms)))
        yield terms
    finally:
        for handle in handles:
            handle.remove()
        model.set_attn_implementation(previous)  # type: ignore[operator]


def _kl_hook(terms: list[torch.Tensor]) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        probs = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        if probs is None:
            raise RuntimeError("attention returned no probabilities; head KL needs eager attention")
        terms.append(head_kl(probs))

    return hook


# ---- online silence re-calibration --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SilenceDrift:
    """One re-calibration: per layer, channels that woke up and that went quiet since the
    previous one, and how many channels the rule marks silent now."""

    step: int
    woke: LayerChannels
    quiet: LayerChannels
    silent_counts: dict[int, int]

    @property
    def num_woke(self) -> int:
        return sum(len(c) for c in self.woke.values())

    @property
    def num_quiet(self) -> int:
        return sum(len(c) for c in self.quiet.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "woke": {str(k): v for k, v in self.woke.items()},
            "quiet": {str(k): v for k, v in self.quiet.items()},
            "silent_counts": {str(k): v for k, v in self.silent_counts.items()},
        }


def silent_mlp_channels(
    model: nn.Module, layers: list[LayerParts], batches: Iterable[torch.Tensor], rule: SilenceRule
) -> LayerChannels:
    """Layer -> FFN channels the silence rule marks silent on `batches` (token ids (1, T))."""
    captured = capture(model, layers, batches, rule)
    return {
        layer: flag_silent(stats, rule)
        for (layer, kind), stats in sorted(captured.units.items())
        if kind == "mlp"
    }


def channel_drift(before: LayerChannels, after: LayerChannels) -> tuple[LayerChannels, ...]:
    """(woke, quiet): per layer, channels silent only before, and silent only after."""
    woke, quiet = {}, {}
    for layer in sorted(set(before) | set(after)):
        old, new = set(before.get(layer, [])), set(after.get(layer, []))
        if old - new:
            woke[layer] = sorted(old - new)
        if new - old:
            quiet[layer] = sorted(new - old)
    return woke, quiet


def mask_of(silent: LayerChannels, num_layers: int, rule: SilenceRule) -> ChannelMask:
    """The plan-A mask of the silent channels, protected (last) layers left out."""
    protected = set(protected_layers(num_layers, rule))
    channels = {k: tuple(v) for k, v in silent.items() if v and k not in protected}
    return ChannelMask(channels)


@dataclass(slots=True)
class SilenceTracker:
    """The current silent set and mask; `recalibrate` re-captures them and reports drift.
    Capture runs with no mask attached, so a masked channel can wake up again."""

    layers: list[LayerParts]
    batches: list[torch.Tensor]
    rule: SilenceRule = field(default_factory=SilenceRule)
    silent: LayerChannels = field(default_factory=dict)
    mask: ChannelMask = field(default_factory=ChannelMask)
    history: list[SilenceDrift] = field(default_factory=list)

    def recalibrate(self, model: nn.Module, step: int) -> SilenceDrift:
        now = silent_mlp_channels(model, self.layers, self.batches, self.rule)
        woke, quiet = channel_drift(self.silent, now) if self.history else ({}, {})
        drift = SilenceDrift(step, woke, quiet, {k: len(v) for k, v in now.items()})
        self.silent, self.mask = now, mask_of(now, len(self.layers), self.rule)
        self.history.append(drift)
        return drift
