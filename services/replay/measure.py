"""Per-request telemetry from the real model, for the alert replay: healthy held-out prompts at
every level (the `evaluation` half of each traffic kind, never seen by the baseline) and the
injected faults at one level, each answer judged by the gateway's own trust judge.

Faults keep the served calibration version, so the window rules judge them against the healthy
baseline of what should be served:
- miscalibrated: the level's thresholds scaled to `MISCALIBRATED_SPARSITY` (a wrong artefact);
- damaged: one mid layer's MLP output zeroed (its down projection's weights set to 0);
- garbage, templated, multilingual, prefix-defeating: inputs (sparse_engine.data.traffic)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from services.config import Settings
from services.gateway.trust import Trust, TrustJudge
from services.shared.engine import build_engine
from sparse_engine.calibration.baseline import run_prompts
from sparse_engine.data import traffic
from sparse_engine.data.corpora import load_texts
from sparse_engine.data.splits import evaluation_tokens
from sparse_engine.model.loader import LoadedModel
from sparse_engine.runtime.engine import Engine
from sparse_engine.runtime.generation import GenerationStats
from sparse_engine.sparsity.plan import Level
from sparse_engine.sparsity.scaled import scale_to_sparsity

log = logging.getLogger(__name__)

FAULTS = ("miscalibrated", "damaged", "garbage", "templated", "multilingual", "prefix-defeating")
MISCALIBRATED_SPARSITY = 0.80
HEALTHY_KINDS = traffic.HEALTHY_KINDS


@dataclass(frozen=True, slots=True)
class Measured:
    """One answered request: what the gateway would put in its telemetry event."""

    condition: str  # healthy | a fault name
    kind: str
    prompt: str
    level: str
    stats: GenerationStats
    trust: Trust
    system: bool = False  # sent behind a system prompt


@contextmanager
def zeroed_mlp(lm: LoadedModel, layer: int) -> Iterator[None]:
    """The MLP of `layer` outputs zeros while inside (the down projection's weights set to 0);
    restored on exit. Build the engine inside: the fast path copies the weights it reads."""
    weight = lm.layers[layer].get("down").weight
    assert isinstance(weight, torch.Tensor)
    saved = weight.detach().clone()
    with torch.no_grad():
        weight.zero_()
    try:
        yield
    finally:
        with torch.no_grad():
            weight.copy_(saved)


def healthy_prompts(settings: Settings, count: int) -> list[traffic.Prompt]:
    """Held-out healthy traffic: every kind's evaluation half, every other prompt of each kind
    with the shared system prompt (as the baseline pass sends them)."""
    prompts = traffic.mix(HEALTHY_KINDS, settings.cache_home, "evaluation", count)
    return traffic.half_with_system(prompts)


def fault_prompts(
    settings: Settings, fault: str, count: int, offset: int = 0
) -> list[traffic.Prompt]:
    """The fault's prompts; `offset` draws them from later in each source (disjoint from the
    healthy pool's first `offset` prompts, and from another fault set's)."""
    home = settings.cache_home
    if fault == "garbage":
        return traffic.garbage(count, seed=offset)
    if fault == "templated":
        return traffic.templated(home, count, index=offset)
    if fault == "multilingual":
        return traffic.language_shift(home, count, offset)
    later = healthy_prompts(settings, offset + count)[offset:]
    if fault == "prefix-defeating":
        return traffic.prefix_defeating(later, seed=offset)
    return later  # model faults: healthy traffic, broken engine


class Measurer:
    """Answers prompts on the served engine and judges them with the gateway's trust judge."""

    def __init__(
        self,
        settings: Settings,
        lm: LoadedModel,
        judge: TrustJudge,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        self.settings, self.lm, self.judge, self.progress = settings, lm, judge, progress
        self.tokens = settings.engine.baseline_max_new_tokens

    def engine(self) -> Engine:
        return build_engine(self.settings, self.lm, prefix_cache=True)

    def healthy(self, level: Level, count: int) -> list[Measured]:
        return self.answer(level, healthy_prompts(self.settings, count))

    def answer(self, level: Level, prompts: list[traffic.Prompt]) -> list[Measured]:
        """Healthy `prompts` answered at `level` and judged."""
        return self._answer(self.engine(), "healthy", level, prompts)

    def fault(self, fault: str, level: Level, count: int, offset: int = 0) -> list[Measured]:
        prompts = fault_prompts(self.settings, fault, count, offset)
        if fault == "damaged":
            with zeroed_mlp(self.lm, len(self.lm.layers) // 2):
                return self._answer(self.engine(), fault, level, prompts)
        engine = self.engine()
        if fault == "miscalibrated":
            served = engine.plan(level)
            wiki = load_texts("wiki", self.settings.cache_home)
            tokens = evaluation_tokens(self.lm.tokenizer, wiki, 512)
            broken = scale_to_sparsity(self.lm, served, tokens, MISCALIBRATED_SPARSITY)
            engine.install(replace(broken, calibration_version=served.calibration_version))
        return self._answer(engine, fault, level, prompts)

    def _answer(
        self, engine: Engine, condition: str, level: Level, prompts: list[traffic.Prompt]
    ) -> list[Measured]:
        # With the readout, as the gateway serves: the trust model reads it.
        answers = run_prompts(
            engine, level, prompts, self.tokens, progress=self.progress, readout=True
        )
        return [
            Measured(
                condition,
                p.kind,
                p.text,
                level.value,
                s,
                self._judge(s, p, level),
                p.system is not None,
            )
            for p, s in zip(prompts, answers, strict=True)
        ]

    def _judge(self, stats: GenerationStats, prompt: traffic.Prompt, level: Level) -> Trust:
        dense = level is Level.DENSE
        return self.judge.assess(stats, prompt.text, dense, system=prompt.system is not None)
