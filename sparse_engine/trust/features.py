"""What the trust score reads about one answer: signals the engine already measured (per-layer
silence, gate confidence and entropy, token log-probabilities and entropies, drift, and the
readout: residual stream and per-head attention, `sparsity.readout`), grouped into the feature
groups a trust model is fit on. No extra forward pass."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from sparse_engine.runtime.generation import GenerationStats
from sparse_engine.sparsity.readout import HIDDEN_AT, AnswerReadout
from sparse_engine.sparsity.signals import LATE_BAND, late_silence

PROBE_DEPTH = 2 / 3  # the channel probe reads the MLP layer two thirds of the way up
PROBE_FLOOR = 1e-4  # log(mean |a| + floor): silent channels stay finite
FEATURES = (
    "late_silence",
    "silence_deviation",
    "mean_silence",
    "gate_confidence",
    "gate_entropy",
    "sparsity_ratio",
    "activation_stability",
    "mean_logprob",
    "min_logprob",
    "mean_entropy",
    "max_entropy",
    "log_length",
    "drift_kl",
    "context_overlap",
)
_WORD = re.compile(r"\w+")


@dataclass(slots=True)
class RequestSignals:
    """The raw signals of one answer, as stored in evaluation records and events."""

    silence_per_layer: list[float] = field(default_factory=list)
    gate_confidence: float = 1.0
    gate_entropy: float = 0.0
    sparsity_ratio: float = 0.0
    activation_stability: float = 0.0
    mean_logprob: float = 0.0
    min_logprob: float = 0.0
    mean_entropy: float = 0.0
    max_entropy: float = 0.0
    length: int = 0
    drift_kl: float | None = None
    context_overlap: float = 0.0
    first_logprob: float = 0.0
    first_entropy: float = 0.0
    prompt_tokens: int = 0
    sparsity_per_layer: list[float] = field(default_factory=list)
    # log(mean |activation| + floor) of each MLP channel of the probe layer over the answer:
    # per-layer silence at channel resolution.
    probe: list[float] = field(default_factory=list)
    readout: AnswerReadout | None = None

    def late_silence(self, late_band: int = LATE_BAND) -> float:
        """Mean silence of the last `late_band` layers (0 without signals)."""
        return late_silence(self.silence_per_layer, late_band)

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["readout"] = self.readout.to_dict() if self.readout is not None else None
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestSignals:
        readout = data.get("readout")
        return cls(**{**data, "readout": AnswerReadout.from_dict(readout) if readout else None})


@dataclass(frozen=True, slots=True)
class SilenceBaseline:
    """Per-layer mean and standard deviation of the silence rate over reference traffic."""

    mean: tuple[float, ...]
    std: tuple[float, ...]

    @classmethod
    def of(cls, rows: Sequence[Sequence[float]]) -> SilenceBaseline:
        """Over the rows of the most common non-zero length (answers without signals have
        none)."""
        lengths = Counter(len(r) for r in rows if r)
        if not lengths:
            return cls((), ())
        width = lengths.most_common(1)[0][0]
        rows = [r for r in rows if len(r) == width]
        columns = list(zip(*rows, strict=True))
        means = [sum(c) / len(c) for c in columns]
        stds = [
            math.sqrt(sum((v - m) ** 2 for v in c) / len(c))
            for c, m in zip(columns, means, strict=True)
        ]
        return cls(tuple(means), tuple(stds))

    def deviation(self, silence: Sequence[float]) -> float:
        """Mean absolute z-score of the per-layer silence against the baseline (0 without one);
        layers that never varied count by how far they moved, in units of 0.01."""
        if len(self.mean) != len(silence) or not silence:
            return 0.0
        z = [
            abs(v - m) / max(s, 0.01) for v, m, s in zip(silence, self.mean, self.std, strict=True)
        ]
        return sum(z) / len(z)


def from_stats(stats: GenerationStats, prompt_text: str) -> RequestSignals:
    s = stats.signals
    logprobs, entropies = stats.token_logprobs, stats.token_entropies
    return RequestSignals(
        silence_per_layer=list(s.silence_rate_per_layer) if s else [],
        gate_confidence=s.gate_confidence if s else 1.0,
        gate_entropy=s.gate_entropy if s else 0.0,
        sparsity_ratio=s.sparsity_ratio if s else 0.0,
        activation_stability=s.activation_stability_pct if s else 0.0,
        mean_logprob=_mean(logprobs),
        min_logprob=min(logprobs, default=0.0),
        mean_entropy=_mean(entropies),
        max_entropy=max(entropies, default=0.0),
        length=stats.completion_tokens,
        drift_kl=stats.semantic_drift_kl,
        context_overlap=context_overlap(prompt_text, stats.text),
        first_logprob=logprobs[0] if logprobs else 0.0,
        first_entropy=entropies[0] if entropies else 0.0,
        prompt_tokens=stats.prompt_tokens,
        sparsity_per_layer=list(s.sparsity_per_layer) if s else [],
        probe=channel_probe(s.answer_channels) if s and s.answer_channels else [],
        readout=stats.readout,
    )


def probe_layer(num_layers: int) -> int:
    return min(num_layers - 1, round(PROBE_DEPTH * num_layers))


def channel_probe(answer_channels: Sequence[torch.Tensor]) -> list[float]:
    means = answer_channels[probe_layer(len(answer_channels))]
    return [round(v, 4) for v in torch.log(means + PROBE_FLOOR).tolist()]


def readout_groups(readout: AnswerReadout | None) -> dict[str, torch.Tensor]:
    """The readout's feature groups: `lookback` and `attn_entropy` (one value per layer and
    head), and `hidden.<where>.<layer>` (the residual stream), where <where> is one of
    HIDDEN_AT. Empty without a readout."""
    if readout is None:
        return {}
    groups = {
        "lookback": readout.lookback.flatten().double(),
        "attn_entropy": readout.entropy.flatten().double(),
    }
    for i, where in enumerate(HIDDEN_AT):
        for j, layer in enumerate(readout.layers):
            groups[f"hidden.{where}.{layer}"] = readout.hidden[i, j].double()
    return groups


def scalar_features(
    sig: RequestSignals, baseline: SilenceBaseline, drift_default: float, late_band: int = LATE_BAND
) -> list[float]:
    silence = sig.silence_per_layer
    return [
        sig.late_silence(late_band),
        baseline.deviation(silence),
        _mean(silence),
        sig.gate_confidence,
        sig.gate_entropy,
        sig.sparsity_ratio,
        sig.activation_stability,
        sig.mean_logprob,
        sig.min_logprob,
        sig.mean_entropy,
        sig.max_entropy,
        math.log1p(sig.length),
        drift_default if sig.drift_kl is None else sig.drift_kl,
        sig.context_overlap,
    ]


def context_overlap(prompt: str, answer: str) -> float:
    """Share of the answer's words that appear in the prompt: an answer read off the passage
    it was given, rather than made up."""
    said = _WORD.findall(answer.lower())
    if not said:
        return 0.0
    seen = set(_WORD.findall(prompt.lower()))
    return sum(w in seen for w in said) / len(said)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def rule_score(sig: RequestSignals, late_band: int = LATE_BAND) -> float:
    """The score without a fitted model: 1 - late-layer silence."""
    return 1.0 - sig.late_silence(late_band)
