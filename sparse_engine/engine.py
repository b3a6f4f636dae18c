"""The sparse engine: streams tokens from a decoder under a level's sparsity plan and ends
with a stats object holding every per-request signal."""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from sparse_engine import signals
from sparse_engine.artefacts import CalibrationNotFoundError, CalibrationStore
from sparse_engine.hooks import sparsified
from sparse_engine.loader import LoadedModel
from sparse_engine.plan import SPARSE_LEVELS, Level, SparsityPlan
from sparse_engine.recorder import SignalRecorder, SignalSummary
from sparse_engine.sampling import sample_next

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


@dataclass(slots=True)
class GenerationStats:
    text: str
    level: str
    calibration_version: str | None
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    time_to_first_token_s: float
    total_s: float
    decode_tokens_per_s: float
    prefill_tokens_per_s: float
    input_entropy_bits_per_char: float
    signals: SignalSummary | None
    semantic_drift_kl: float | None = None
    token_ids: list[int] = field(default_factory=list)


class Generation:
    """Iterate for text deltas; `stats` is set once iteration ends."""

    def __init__(self, deltas: Iterator[str]) -> None:
        self._deltas = deltas
        self.stats: GenerationStats | None = None

    def __iter__(self) -> Iterator[str]:
        return self._deltas

    def result(self) -> GenerationStats:
        """Run to the end and return the stats."""
        for _ in self:
            pass
        if self.stats is None:
            raise RuntimeError("generation ended without stats")
        return self.stats


class Engine:
    """One model, its level plans, and generation. Hooks live only for the duration of a
    forward pass, so the model is dense whenever no request is running. Not thread-safe: run
    one request at a time per engine."""

    def __init__(self, lm: LoadedModel, plans: dict[Level, SparsityPlan]) -> None:
        self.lm = lm
        self.plans = {Level.DENSE: SparsityPlan(), **plans}
        self._keeps_logits = "logits_to_keep" in inspect.signature(lm.model.forward).parameters

    @classmethod
    def from_store(cls, lm: LoadedModel, store: CalibrationStore) -> Engine:
        """Bind each sparse level to its latest calibration for this model's weights."""
        plans = {}
        for level in SPARSE_LEVELS:
            try:
                plans[level] = store.latest(lm.weights_sha256, level).plan()
            except CalibrationNotFoundError:
                continue
        if plans:
            reference = next(iter(plans.values()))
            plans[Level.DENSE] = reference.as_dense()
        return cls(lm, plans)

    def plan(self, level: Level) -> SparsityPlan:
        if level not in self.plans:
            raise CalibrationNotFoundError(
                f"level '{level.value}' has no calibration for {self.lm.model_id}; "
                f"run `sparseguard calibrate --level {level.value}`"
            )
        return self.plans[level]

    def encode(self, request: GenerationRequest) -> tuple[list[int], str]:
        """Token ids of the prompt (chat template applied to messages) and its plain text."""
        tokenizer = self.lm.tokenizer
        if request.messages is not None:
            text = tokenizer.apply_chat_template(
                request.messages, tokenize=False, add_generation_prompt=True
            )
            plain = "\n".join(m["content"] for m in request.messages)
        elif request.prompt is not None:
            text = plain = request.prompt
        else:
            raise ValueError("a request needs messages or a prompt")
        ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids, plain

    def generate(self, request: GenerationRequest, level: Level = Level.DENSE) -> Generation:
        plan = self.plan(level)
        ids, plain = self.encode(request)
        self._check_length(len(ids), request.max_new_tokens)
        generation = Generation(iter(()))
        generation._deltas = self._stream(generation, request, plan, ids, plain)
        return generation

    def semantic_drift(
        self, prompt_ids: list[int], generated: list[int], sparse_logits: torch.Tensor
    ) -> float:
        """Mean token-level KL(dense || sparse) over the generated tokens, by teacher-forcing
        the sparse output through the dense model (one forward pass)."""
        if not generated:
            return 0.0
        ids = torch.tensor([prompt_ids + generated[:-1]])
        with torch.inference_mode():
            dense = self.lm.model(input_ids=ids).logits[0, len(prompt_ids) - 1 :]
        return float(signals.token_kl(dense, sparse_logits).mean())

    def _check_length(self, prompt_tokens: int, max_new_tokens: int) -> None:
        context = int(getattr(self.lm.model.config, "max_position_embeddings", 0) or 0)
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if context and prompt_tokens + max_new_tokens > context:
            raise ValueError(
                f"prompt of {prompt_tokens} tokens plus max_new_tokens={max_new_tokens} exceeds "
                f"the model's context of {context} tokens; shorten the prompt or lower max_tokens"
            )

    def _stream(
        self,
        out: Generation,
        request: GenerationRequest,
        plan: SparsityPlan,
        prompt_ids: list[int],
        plain: str,
    ) -> Iterator[str]:
        recorder = (
            SignalRecorder(self.lm.num_layers, plan.silence_thresholds)
            if request.collect_signals
            else None
        )
        decoder = _TextStream(self.lm.tokenizer, request.stop)
        generator = (
            torch.Generator().manual_seed(request.seed) if request.seed is not None else None
        )
        eos = _eos_ids(self.lm)
        cache = DynamicCache(config=self.lm.model.config)
        generated: list[int] = []
        kept_logits: list[torch.Tensor] = []
        finish = "length"
        started = time.perf_counter()
        first_token_at = started
        next_input = torch.tensor([prompt_ids])
        with torch.inference_mode(), sparsified(self.lm.layers, plan, recorder):
            for step in range(request.max_new_tokens):
                logits = self._forward(next_input, cache, recorder)
                if request.measure_drift and not plan.is_dense:
                    kept_logits.append(logits.float())
                token = sample_next(logits, request.temperature, request.top_p, generator)
                if step == 0:
                    first_token_at = time.perf_counter()
                if token in eos and not request.ignore_eos:
                    finish = "stop"
                    break
                generated.append(token)
                delta, stopped = decoder.push(generated)
                if delta:
                    yield delta
                if stopped:
                    finish = "stop"
                    break
                next_input = torch.tensor([[token]])
        tail = decoder.flush(generated)
        if tail:
            yield tail
        ended = time.perf_counter()
        drift = None
        if request.measure_drift:
            drift = (
                0.0
                if plan.is_dense
                else self.semantic_drift(
                    prompt_ids,
                    generated,
                    torch.stack(kept_logits[: len(generated)]) if generated else torch.empty(0),
                )
            )
        out.stats = GenerationStats(
            text=decoder.text,
            level=plan.level.value,
            calibration_version=plan.calibration_version,
            prompt_tokens=len(prompt_ids),
            completion_tokens=len(generated),
            finish_reason=finish,
            time_to_first_token_s=first_token_at - started,
            total_s=ended - started,
            decode_tokens_per_s=(len(generated) - 1) / (ended - first_token_at)
            if len(generated) > 1
            else 0.0,
            prefill_tokens_per_s=len(prompt_ids) / max(first_token_at - started, 1e-9),
            input_entropy_bits_per_char=signals.entropy_bits_per_char(plain),
            signals=recorder.summary() if recorder is not None else None,
            semantic_drift_kl=drift,
            token_ids=generated,
        )

    def _forward(
        self, ids: torch.Tensor, cache: DynamicCache, recorder: SignalRecorder | None
    ) -> torch.Tensor:
        kwargs: dict[str, Any] = {"logits_to_keep": 1} if self._keeps_logits else {}
        if recorder is not None:
            recorder.begin_step()
        logits = self.lm.model(input_ids=ids, cache=cache, use_cache=True, **kwargs).logits[0, -1]
        if recorder is not None:
            recorder.end_step()
        return logits  # type: ignore[no-any-return]


class _TextStream:
    """Incremental detokenisation that never splits a character or emits a stop string."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.emitted = 0
        self.text = ""

    def push(self, ids: list[int]) -> tuple[str, bool]:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        for s in self.stop:
            cut = text.find(s)
            if cut >= 0:
                self.text = text[:cut]
                return self._take(len(self.text)), True
        self.text = text
        if text.endswith("\ufffd"):
            return "", False
        return self._take(len(text) - self.holdback), False

    def flush(self, ids: list[int]) -> str:
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta


def _eos_ids(lm: LoadedModel) -> set[int]:
    found: set[int] = set()
    for value in (
        lm.tokenizer.eos_token_id,
        getattr(lm.model.generation_config, "eos_token_id", None),
    ):
        if isinstance(value, int):
            found.add(value)
        elif isinstance(value, list):
            found.update(v for v in value if isinstance(v, int))
    return found
