"""What a caller asks the engine for, and what it gets back."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from sparse_engine.runtime.sampling import TopLogprobs
from sparse_engine.sparsity.readout import AnswerReadout
from sparse_engine.sparsity.recorder import SignalSummary

Message = dict[str, str]


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    messages: list[Message] | None = None
    prompt: str | None = None
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    measure_drift: bool = False
    collect_signals: bool = True
    ignore_eos: bool = False
    use_prefix_cache: bool = True
    readout: bool = False  # the trust readout (sparsity.readout) of the answer
    # A prompt given as token ids, used as is (no template, no BOS added): `prompt` unused.
    prompt_ids: list[int] | None = None
    top_k: int = 0  # 0: no top-k cut
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    top_logprobs: int = 0  # how many likeliest alternatives to keep per generated position
    echo_logprobs: bool = False  # also the log-probabilities of the prompt's own tokens


@dataclass(slots=True)
class GenerationStats:
    text: str
    level: str
    calibration_version: str | None
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # stop | length | cancelled
    time_to_first_token_s: float
    decode_tokens_per_s: float
    prefill_tokens_per_s: float
    input_entropy_bits_per_char: float
    signals: SignalSummary | None
    semantic_drift_kl: float | None = None
    cached_tokens: int = 0
    cache_mismatch: bool = False
    token_ids: list[int] = field(default_factory=list)
    # Per generated position: log-probability of the chosen token and entropy of the
    # distribution it was drawn from (nats), under the level that produced it.
    token_logprobs: list[float] = field(default_factory=list)
    token_entropies: list[float] = field(default_factory=list)
    readout: AnswerReadout | None = None
    stop_token: int | None = None  # the end-of-sequence token that ended it, if one did
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    # With `echo_logprobs`: the prompt's token ids, each one's log-probability given those
    # before it (None for the first) and the likeliest alternatives there.
    prompt_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    batch_size: float = 1.0  # mean sequences per decode step it ran in (scheduler batching)

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class Generation:
    """Iterate for text deltas; `stats` is set once iteration ends. `cancel()` (from any
    thread) stops decoding after the current token; the stats then say `cancelled`."""

    def __init__(self) -> None:
        self._deltas: Iterator[str] = iter(())
        self.stats: GenerationStats | None = None
        self.cancelled = threading.Event()

    def __iter__(self) -> Iterator[str]:
        return self._deltas

    def cancel(self) -> None:
        self.cancelled.set()

    def result(self) -> GenerationStats:
        """Run to the end and return the stats."""
        for _ in self:
            pass
        if self.stats is None:
            raise RuntimeError("generation ended without stats")
        return self.stats
