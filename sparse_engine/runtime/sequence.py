"""One request's decoding apart from the forward passes that feed it: sampling, stop rules,
cancellation and the statistics it ends with. The engine feeds one sequence alone
(`Engine.generate`); the scheduler (`runtime.scheduler`) feeds many, a batched step at a time.
Either way a sequence sees only its own logits and its own recorder, so its signals are the
same."""

from __future__ import annotations

import threading
import time

import torch

from sparse_engine.model.chat import template_stops
from sparse_engine.model.loader import LoadedModel
from sparse_engine.runtime.fastpath import FastDecoder
from sparse_engine.runtime.generation import GenerationRequest, GenerationStats
from sparse_engine.runtime.prefill import Prefilled
from sparse_engine.runtime.sampling import LogitAdjust, TokenConfidence, TopLogprobs, eos_ids
from sparse_engine.runtime.sampling import sample_next as sample
from sparse_engine.runtime.textstream import TextStream
from sparse_engine.sparsity import signals
from sparse_engine.sparsity.plan import SparsityPlan
from sparse_engine.sparsity.readout import Readout
from sparse_engine.sparsity.recorder import SignalRecorder


class Sequence:
    """Feed it the logits of each position in turn (`accept`); it picks the next token
    (`token`) until `done`. `fast` is the fast decoder that runs it, None for the reference
    path."""

    def __init__(
        self,
        lm: LoadedModel,
        request: GenerationRequest,
        plan: SparsityPlan,
        prompt_ids: list[int],
        plain: str,
        cancelled: threading.Event,
        fast: FastDecoder | None,
        readout: Readout | None,
    ) -> None:
        self.request, self.plan, self.prompt_ids, self.plain = request, plan, prompt_ids, plain
        self.cancelled = cancelled
        self.recorder = (
            SignalRecorder(lm.num_layers, plan.silence_thresholds)
            if request.collect_signals
            else None
        )
        stops = request.stop
        if request.messages is not None and not request.ignore_eos:
            stops += template_stops(lm.tokenizer)
        self.stream = TextStream(lm.tokenizer, stops)
        self.generator = (
            torch.Generator().manual_seed(request.seed) if request.seed is not None else None
        )
        self.eos = set() if request.ignore_eos else eos_ids(lm)
        self.adjust = LogitAdjust(
            int(lm.model.get_output_embeddings().weight.shape[0]),
            request.presence_penalty,
            request.frequency_penalty,
            request.logit_bias,
        )
        self.confidence = TokenConfidence(request.top_logprobs)
        self.fast, self.readout = fast, readout
        self.generated: list[int] = []
        self.kept_logits: list[torch.Tensor] = []
        self.token = -1
        self.steps = 0
        self.done = False
        self.finish = "length"
        self.stop_token: int | None = None
        self.started = time.perf_counter()
        self.first_token_at = self.started
        self.prefilled = Prefilled(torch.empty(0), 0, False)
        self.batch_sizes = 0  # summed over decode steps (see `batch_size`)

    @property
    def length(self) -> int:
        """Positions in its KV cache: the prompt and every token fed back so far."""
        return len(self.prompt_ids) + max(self.steps - 1, 0)

    @property
    def batch_size(self) -> float:
        """Mean number of sequences its decode steps ran beside (itself included)."""
        steps = self.steps - 1
        return self.batch_sizes / steps if steps > 0 else 1.0

    def accept(self, logits: torch.Tensor) -> str:
        """The logits of its latest position: choose the next token and return the new text."""
        request = self.request
        if self.steps == 0:
            self.first_token_at = time.perf_counter()
        self.steps += 1
        if request.measure_drift and not self.plan.is_dense:
            self.kept_logits.append(logits.float().clone())  # may be a batch's row
        token = sample(
            self.adjust(logits), request.temperature, request.top_p, self.generator, request.top_k
        )
        self.adjust.chose(token)
        if self.recorder is not None or request.top_logprobs:
            self.confidence.observe(logits, token)
        self.token = token
        if token in self.eos:
            self.finish, self.stop_token, self.done = "stop", token, True
            return ""
        self.generated.append(token)
        delta, stopped = self.stream.push(self.generated)
        if stopped or self.cancelled.is_set():
            self.finish, self.done = ("stop" if stopped else "cancelled"), True
        elif self.steps >= request.max_new_tokens:
            self.done = True
        return delta

    def drift_input(self) -> tuple[list[int], list[int], torch.Tensor] | None:
        """What the KL drift pass needs (prompt, answer, the sparse logits of each answer
        token), or None when the request asked for no drift or it is 0 by definition."""
        if not self.request.measure_drift or self.plan.is_dense or not self.generated:
            return None
        sparse = torch.stack(self.kept_logits[: len(self.generated)])
        return self.prompt_ids, self.generated, sparse

    def stats(
        self,
        drift: float | None,
        echo: tuple[list[float | None], list[TopLogprobs]],
        ended: float,
    ) -> GenerationStats:
        n, prompt = len(self.generated), self.prompt_ids
        decode_s = ended - self.first_token_at
        cached = self.prefilled.cached
        ttft = self.first_token_at - self.started
        return GenerationStats(
            text=self.stream.text,
            level=self.plan.level.value,
            calibration_version=self.plan.calibration_version,
            prompt_tokens=len(prompt),
            completion_tokens=n,
            finish_reason=self.finish,
            time_to_first_token_s=ttft,
            decode_tokens_per_s=(n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
            prefill_tokens_per_s=(len(prompt) - cached) / max(ttft, 1e-9),
            input_entropy_bits_per_char=signals.entropy_bits_per_char(self.plain),
            signals=self.recorder.summary() if self.recorder is not None else None,
            semantic_drift_kl=drift,
            cached_tokens=cached,
            cache_mismatch=self.prefilled.mismatch,
            token_ids=self.generated,
            token_logprobs=self.confidence.logprobs,
            token_entropies=self.confidence.entropies,
            readout=self.readout.result() if self.readout is not None else None,
            stop_token=self.stop_token,
            top_logprobs=self.confidence.top_logprobs,
            prompt_ids=list(prompt) if self.request.echo_logprobs else [],
            prompt_logprobs=echo[0],
            prompt_top_logprobs=echo[1],
            batch_size=self.batch_size,
        )
