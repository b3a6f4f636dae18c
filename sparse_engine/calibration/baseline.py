"""The healthy baseline of one level: healthy prompts of several kinds through the engine as
served, every per-request signal recorded, and per signal the distribution that says how
unusual a value is (a conformal p-value against the sorted sample), its robust statistics, and
the tolerance a window mean needs (how far the mean of one healthy kind of traffic moved from
the mean of all kinds).

The baseline is part of a calibration artefact (plain JSON, `LevelBaseline.to_dict`), so it is
versioned with the plan and travels with it on the control topic."""

from __future__ import annotations

import bisect
import logging
import math
import statistics
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from sparse_engine.calibration.conformal import ceiling_rank
from sparse_engine.data.traffic import Prompt
from sparse_engine.runtime.engine import Engine
from sparse_engine.runtime.generation import GenerationRequest, GenerationStats
from sparse_engine.runtime.offline import generate_all
from sparse_engine.sparsity.plan import Level
from sparse_engine.sparsity.signals import LATE_BAND, late_silence, prompt_category

log = logging.getLogger(__name__)

# Per-request signals a baseline describes (names of `request_values` keys).
SIGNALS = (
    "sparsity_ratio",
    "gate_confidence",
    "gate_entropy",
    "activation_stability_pct",
    "late_silence",
    "semantic_drift_kl",
    "decode_tokens_per_s",
)
QUANTILES = 100  # the stored quantiles: 0, 1/100, ..., 1


@dataclass(frozen=True, slots=True)
class SignalBaseline:
    """One signal's healthy distribution."""

    n: int
    mean: float
    sd: float
    median: float
    mad: float  # median absolute deviation, scaled to the sd of a normal distribution
    tolerance: float  # largest |mean of one kind - mean of all|
    kind_means: dict[str, float]
    quantiles: list[float]
    values: list[float]  # the sorted sample
    kind_values: dict[str, list[float]] = field(default_factory=dict)  # each kind's, sorted
    # Each kind's values from requests behind a system prompt (a subset of its kind_values),
    # and how far the system prompt moves the kind (system - plain, Hodges-Lehmann).
    system_values: dict[str, list[float]] = field(default_factory=dict)
    system_shift: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(
        cls, by_kind: dict[str, list[float]], system: dict[str, list[float]] | None = None
    ) -> SignalBaseline:
        """`by_kind`: each kind's values; `system`: those of them (by kind) measured behind
        a system prompt."""
        kind_values = {k: sorted(round(v, 6) for v in vs) for k, vs in by_kind.items() if vs}
        system_values = {
            k: sorted(round(v, 6) for v in vs) for k, vs in (system or {}).items() if vs
        }
        values = sorted(v for vs in kind_values.values() for v in vs)
        if not values:
            raise ValueError("a signal baseline needs at least one value")
        mean = statistics.fmean(values)
        median = statistics.median(values)
        kind_means = {k: statistics.fmean(vs) for k, vs in kind_values.items()}
        return cls(
            n=len(values),
            mean=mean,
            sd=statistics.pstdev(values),
            median=median,
            mad=1.4826 * statistics.median(abs(v - median) for v in values),
            tolerance=max(abs(m - mean) for m in kind_means.values()),
            kind_means=kind_means,
            quantiles=[_quantile(values, i / QUANTILES) for i in range(QUANTILES + 1)],
            values=values,
            kind_values=kind_values,
            system_values=system_values,
            system_shift={
                k: _shift(plain, system_values[k])
                for k, vs in kind_values.items()
                if k in system_values and (plain := _without(vs, system_values[k]))
            },
        )

    def p_above(self, value: float) -> float:
        """Conformal p-value of `value` being this high: (1 + #{healthy >= value}) / (n + 1).
        On healthy traffic exchangeable with the sample, P(p <= a) <= a for every a."""
        return _p_above(self.values, value)

    def unusual(
        self,
        value: float,
        budget: float,
        confidence: float = 0.0,
        kinds: Collection[str] | None = None,
        system: bool | None = None,
    ) -> bool:
        """`value` is more unusual than `budget` of healthy requests of every kind (of
        `kinds`, default all), each kind's sample moved to the request's side of the system
        prompt (`system`; None: as measured). A request of any one kind exchangeable with its
        sample fires with probability at most `budget`, and with `confidence` over the draw
        of the sample where the sample is large enough (`ceiling_rank`); the pooled sample
        alone held it on the mix only (late silence fired on 10 % of Qwen's code at 1 %,
        README). Where a kind's sample is too small to spend the budget, or the baseline
        predates per-kind samples, the pooled sample."""
        return all(
            len(vs) - bisect.bisect_left(vs, value) < ceiling_rank(len(vs), budget, confidence)
            for vs in self.samples(budget, kinds, system)
        )

    def samples(
        self, budget: float, kinds: Collection[str] | None = None, system: bool | None = None
    ) -> list[list[float]]:
        """The sorted samples a value is tested against at `budget`: each kind's of `kinds`
        (default all) on the request's side (`kind_sample`), or the pooled sample where one
        of them is too small to spend the budget (n + 1 < 1 / budget) or none was kept."""
        found = [self.kind_sample(k, system) for k in self.kind_values if not kinds or k in kinds]
        if not found or min(len(vs) for vs in found) + 1 < 1 / budget:
            return [self.values]
        return found

    def kind_sample(self, kind: str, system: bool | None = None) -> list[float]:
        """`kind`'s sorted sample as a request with (`system` True) or without a system
        prompt would have measured it: the other side's values moved by the kind's shift."""
        shift = self.system_shift.get(kind)
        values = self.kind_values[kind]
        if system is None or shift is None:
            return values
        with_system = self.system_values[kind]
        plain = _without(values, with_system)
        if system:
            return sorted([*with_system, *(v + shift for v in plain)])
        return sorted([*plain, *(v - shift for v in with_system)])

    def p_below(self, value: float) -> float:
        at_most = bisect.bisect_right(self.values, value)
        return (1 + at_most) / (self.n + 1)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SignalBaseline:
        return cls(**data)


@dataclass(frozen=True, slots=True)
class LevelBaseline:
    """Every signal's healthy distribution at one level, and how it was measured."""

    level: str
    requests: int
    kinds: list[str]
    max_new_tokens: int
    signals: dict[str, SignalBaseline]
    silence_per_layer: list[SignalBaseline] = field(default_factory=list)
    sparsity_per_layer: list[SignalBaseline] = field(default_factory=list)
    categories: dict[str, str] = field(default_factory=dict)  # kind -> most of its prompts'

    def get(self, signal: str) -> SignalBaseline | None:
        return self.signals.get(signal)

    def kinds_of(self, category: str | None) -> list[str] | None:
        """The kinds whose prompts are mostly of `category` (`sparsity.signals.prompt_category`):
        the kinds a request of that category is compared with. None (every kind) for no
        category, a baseline made before categories were kept, or a category no kind has."""
        kinds = [k for k, c in self.categories.items() if c == category]
        return kinds or None

    def pooled(self) -> LevelBaseline:
        """The same baseline without the kinds' own samples: its reasons test against the
        pooled sample (as before per-kind tests; the alert study compares the two)."""
        signals = {
            k: replace(v, kind_values={}, system_values={}, system_shift={})
            for k, v in self.signals.items()
        }
        return replace(self, signals=signals)

    def to_dict(self) -> dict[str, Any]:
        return {
            "level": self.level,
            "requests": self.requests,
            "kinds": self.kinds,
            "max_new_tokens": self.max_new_tokens,
            "signals": {k: v.to_dict() for k, v in self.signals.items()},
            "silence_per_layer": [s.to_dict() for s in self.silence_per_layer],
            "sparsity_per_layer": [s.to_dict() for s in self.sparsity_per_layer],
            "categories": self.categories,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LevelBaseline:
        return cls(
            level=data["level"],
            requests=data["requests"],
            kinds=list(data["kinds"]),
            max_new_tokens=data["max_new_tokens"],
            signals={k: SignalBaseline.from_dict(v) for k, v in data["signals"].items()},
            silence_per_layer=[SignalBaseline.from_dict(s) for s in data["silence_per_layer"]],
            sparsity_per_layer=[SignalBaseline.from_dict(s) for s in data["sparsity_per_layer"]],
            categories=dict(data.get("categories", {})),
        )


def request_values(stats: GenerationStats, late_band: int = LATE_BAND) -> dict[str, float]:
    """The scalar signals of one answer (a signal the request did not measure is left out)."""
    found: dict[str, float] = {"decode_tokens_per_s": stats.decode_tokens_per_s}
    s = stats.signals
    if s is not None:
        found.update(
            sparsity_ratio=s.sparsity_ratio,
            gate_confidence=s.gate_confidence,
            gate_entropy=s.gate_entropy,
            activation_stability_pct=s.activation_stability_pct,
            late_silence=late_silence(s.silence_rate_per_layer, late_band),
        )
    if stats.semantic_drift_kl is not None:
        found["semantic_drift_kl"] = stats.semantic_drift_kl
    return {k: v for k, v in found.items() if math.isfinite(v)}


def run_prompts(
    engine: Engine,
    level: Level,
    prompts: Sequence[Prompt],
    max_new_tokens: int,
    measure_drift: bool = True,
    progress: Callable[[int], None] | None = None,
    readout: bool = False,
    drift_share: float = 1.0,
) -> list[GenerationStats]:
    """Each prompt's greedy answer at `level`, with its signals, as the gateway asks for them
    and serves them: batched (`runtime.offline`), the prefix cache on, so shared prefixes hit
    as they do when served. `readout`: also what a trust model reads, as the gateway asks.
    `drift_share`: the share of each kind's prompts whose answers measure KL drift
    (`drift_sampled`)."""
    drift = measure_drift and level is not Level.DENSE
    sampled = drift_sampled(prompts, drift_share)
    requests = [
        GenerationRequest(
            messages=p.messages(),
            max_new_tokens=max_new_tokens,
            temperature=0.0,
            measure_drift=drift and chosen,
            readout=readout,
        )
        for p, chosen in zip(prompts, sampled, strict=True)
    ]
    return generate_all(engine, [(r, level) for r in requests], progress=progress)


def drift_sampled(prompts: Sequence[Prompt], share: float) -> list[bool]:
    """Which prompts measure drift: `share` of each kind's, spread evenly over its prompts and
    taken in neighbouring pairs, so both sides of `traffic.half_with_system` (every other
    prompt of a kind) are measured alike. A drift pass costs a dense prefill of prompt and
    answer; on every sparse request it took half of a sparse level's baseline pass (README)."""
    if not 0 < share <= 1:
        raise ValueError(f"drift share {share} is not in (0, 1]")
    seen: Counter[str] = Counter()
    found = []
    for p in prompts:
        pair = seen[p.kind] // 2
        seen[p.kind] += 1
        found.append(math.floor((pair + 1) * share + 1e-9) > math.floor(pair * share + 1e-9))
    return found


def summarise(
    level: Level,
    prompts: Sequence[Prompt],
    answers: Sequence[GenerationStats],
    max_new_tokens: int,
    late_band: int = LATE_BAND,
) -> LevelBaseline:
    """The baseline of `answers` (one per prompt, in order)."""
    by_signal: dict[str, dict[str, list[float]]] = {}
    system: dict[str, dict[str, list[float]]] = {}
    silence: list[dict[str, list[float]]] = []
    sparsity: list[dict[str, list[float]]] = []
    for prompt, stats in zip(prompts, answers, strict=True):
        for name, value in request_values(stats, late_band).items():
            by_signal.setdefault(name, {}).setdefault(prompt.kind, []).append(value)
            if prompt.system:
                system.setdefault(name, {}).setdefault(prompt.kind, []).append(value)
        if stats.signals is not None:
            _add_layers(silence, prompt.kind, stats.signals.silence_rate_per_layer)
            _add_layers(sparsity, prompt.kind, stats.signals.sparsity_per_layer)
    kinds = sorted({p.kind for p in prompts})
    return LevelBaseline(
        level=level.value,
        requests=len(answers),
        kinds=kinds,
        max_new_tokens=max_new_tokens,
        signals={
            name: SignalBaseline.of(by_signal[name], system.get(name))
            for name in SIGNALS
            if name in by_signal
        },
        silence_per_layer=[SignalBaseline.of(layer) for layer in silence],
        sparsity_per_layer=[SignalBaseline.of(layer) for layer in sparsity],
        categories=kind_categories(prompts),
    )


def kind_categories(prompts: Sequence[Prompt]) -> dict[str, str]:
    """Each kind's category: the one most of its prompts have (a tie: the first by name)."""
    counts: dict[str, Counter[str]] = {}
    for p in prompts:
        counts.setdefault(p.kind, Counter())[prompt_category(p.text)] += 1
    return {k: max(sorted(c), key=lambda cat: c[cat]) for k, c in counts.items()}


def _add_layers(into: list[dict[str, list[float]]], kind: str, values: Sequence[float]) -> None:
    while len(into) < len(values):
        into.append({})
    for layer, value in enumerate(values):
        into[layer].setdefault(kind, []).append(value)


def _shift(plain: Sequence[float], system: Sequence[float]) -> float:
    """Hodges-Lehmann: the median of every system - plain difference."""
    return statistics.median(s - p for s in system for p in plain)


def _without(values: Sequence[float], some: Sequence[float]) -> list[float]:
    """`values` less the multiset `some` (sorted stays sorted)."""
    left = Counter(some)
    kept = []
    for v in values:
        if left[v]:
            left[v] -= 1
        else:
            kept.append(v)
    return kept


def _p_above(ordered: Sequence[float], value: float) -> float:
    at_least = len(ordered) - bisect.bisect_left(ordered, value)
    return (1 + at_least) / (len(ordered) + 1)


def _quantile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    pos = q * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)
