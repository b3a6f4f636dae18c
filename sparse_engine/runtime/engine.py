"""The sparse engine: streams tokens from a decoder under a level's sparsity plan and ends
with a stats object holding every per-request signal."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, nullcontext
from typing import Any

import torch
from transformers import DynamicCache

from sparse_engine.model.arch import UnsupportedModelError
from sparse_engine.model.loader import LoadedModel
from sparse_engine.runtime.fastpath import FastDecoder
from sparse_engine.runtime.generation import Generation, GenerationRequest, GenerationStats, Message
from sparse_engine.runtime.heads import keeps_logits, span_logits
from sparse_engine.runtime.prefill import (
    FastKV,
    FastKVState,
    OpenPrefill,
    Prefill,
    ReferenceKV,
)
from sparse_engine.runtime.prefix_cache import CacheKey, PrefixCache
from sparse_engine.runtime.sampling import TopLogprobs
from sparse_engine.runtime.sequence import Sequence
from sparse_engine.sparsity import signals
from sparse_engine.sparsity.hooks import read_out, sparsified
from sparse_engine.sparsity.masking import ChannelMask, masked
from sparse_engine.sparsity.plan import (
    CalibrationNotFoundError,
    Level,
    SparsityPlan,
)
from sparse_engine.sparsity.readout import Readout
from sparse_engine.sparsity.recorder import SignalRecorder

__all__ = ["Engine", "Generation", "GenerationRequest", "GenerationStats", "Message"]
log = logging.getLogger(__name__)
# Padded tokens a batched drift pass may spend per real token (`length_groups`).
PADDING_WASTE = 1.25


class Engine:
    """One model, its level plans, and generation. Hooks live only for the duration of a
    forward pass, so the model is dense whenever no request is running. Not thread-safe: one
    thread drives it (`generate` for one request, `runtime.scheduler` for many at once); only
    `install` may be called from another thread."""

    def __init__(
        self,
        lm: LoadedModel,
        plans: dict[Level, SparsityPlan],
        prefix_cache: PrefixCache[DynamicCache] | None = None,
        mask: ChannelMask | None = None,
    ) -> None:
        self.lm = lm
        self.plans = {Level.DENSE: SparsityPlan(), **plans}
        self.prefix_cache = prefix_cache
        self.mask: ChannelMask | None = None
        self.set_mask(mask)
        self._keeps_logits = keeps_logits(lm.model)
        self.fast: FastDecoder | None = None
        # The fast path's own prefixes (its KV is laid out apart from the Hugging Face cache).
        self.fast_prefixes: PrefixCache[FastKVState] | None = None
        for plan in plans.values():
            _say_path(plan)

    def enable_fast_path(
        self, dtype: str = "float32", native: Any = None, max_len: int = 2048
    ) -> None:
        """Decode with the lean path (`sparse_engine.runtime.fastpath`; `native` is the compiled
        module) wherever it applies: a Llama-family model, a threshold plan, no channel mask,
        a sequence within `max_len`. Other requests take the Hugging Face path."""
        try:
            self.fast = FastDecoder(self.lm, max_len, dtype, native)
            cache = self.prefix_cache
            if cache is not None:
                self.fast_prefixes = PrefixCache(cache.max_tokens, cache.min_reuse)
        except UnsupportedModelError as exc:
            log.warning(
                "fast decode path off for %s, serving on the reference path: %s",
                self.lm.model_id,
                exc,
            )

    def plan(self, level: Level | SparsityPlan) -> SparsityPlan:
        """The level's current plan; a plan passed in (pinned when a request was admitted) is
        returned as is, so the request runs on it even after an `install`."""
        if isinstance(level, SparsityPlan):
            return level
        plan = self.plans.get(level)
        if plan is None:
            raise CalibrationNotFoundError(
                f"level '{level.value}' has no calibration for {self.lm.model_id}; "
                f"run `sparseguard calibrate --level {level.value}`"
            )
        return plan

    def install(self, plan: SparsityPlan) -> None:
        """Make `plan` its level's plan for requests admitted from now on. The plans dict is
        replaced, never changed in place, so a reader on another thread sees the old or the
        new one whole. The dense plan gets the silence reference if it had none."""
        if plan.level is Level.DENSE:
            raise ValueError("the dense level has no calibration to install")
        self._check_fits(plan)
        _say_path(plan)
        plans = {**self.plans, plan.level: plan}
        if plans[Level.DENSE].silence_thresholds is None:
            plans[Level.DENSE] = plan.as_dense()
        self.plans = plans

    def set_mask(self, mask: ChannelMask | None) -> None:
        """Plan A: mask silent channels / layers in every forward pass from now on, under
        every level (the mask acts as part of the model; sparsity plans apply on top)."""
        if mask is not None:
            mask.check_fits(self.lm.layers)
        self.mask = mask if mask is not None and not mask.is_empty else None

    def _check_fits(self, plan: SparsityPlan) -> None:
        per_layer = [*plan.thresholds.values(), plan.topk, plan.silence_thresholds]
        lengths = {len(values) for values in per_layer if values is not None}
        if plan.gates is not None:
            lengths.add(plan.gates.num_layers)
        if lengths - {self.lm.num_layers}:
            raise ValueError(
                f"plan {plan.calibration_version} has per-layer settings for "
                f"{sorted(lengths)} layers but {self.lm.model_id} has {self.lm.num_layers}"
            )

    def encode(self, request: GenerationRequest) -> tuple[list[int], str]:
        """Token ids of the prompt (chat template applied to messages) and its plain text."""
        if request.prompt_ids is not None:
            return list(request.prompt_ids), self.lm.tokenizer.decode(request.prompt_ids)
        if request.messages is not None:
            return self.encode_messages(request.messages), _plain(request.messages)
        if request.prompt is not None:
            return [*self.lm.bos_prefix, *self.encode_text(request.prompt)], request.prompt
        raise ValueError("a request needs messages or a prompt")

    def encode_messages(self, messages: list[Message]) -> list[int]:
        text = self.lm.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return self.encode_text(text)

    def encode_text(self, text: str) -> list[int]:
        return list(self.lm.tokenizer(text, add_special_tokens=False)["input_ids"])

    def check_length(self, prompt_tokens: int, max_new_tokens: int) -> None:
        context = int(getattr(self.lm.model.config, "max_position_embeddings", 0) or 0)
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if context and prompt_tokens + max_new_tokens > context:
            raise ValueError(
                f"prompt of {prompt_tokens} tokens plus max_new_tokens={max_new_tokens} exceeds "
                f"the model's context of {context} tokens; shorten the prompt or lower max_tokens"
            )

    def generate(
        self, request: GenerationRequest, level: Level | SparsityPlan = Level.DENSE
    ) -> Generation:
        """Stream under `level`'s current plan, or under the given (pinned) plan."""
        plan = self.plan(level)
        generation = Generation()
        seq = self.start(request, plan, generation.cancelled)
        generation._deltas = self._stream(generation, seq)
        return generation

    def semantic_drift(
        self, prompt_ids: list[int], generated: list[int], sparse_logits: torch.Tensor
    ) -> float:
        """Mean token-level KL(dense || sparse) over the generated tokens, by teacher-forcing
        the sparse output through the dense model (one forward pass)."""
        if not generated:
            return 0.0
        ids = torch.tensor([prompt_ids + generated[:-1]])
        span = [(len(prompt_ids) - 1, ids.shape[1])]
        with torch.inference_mode(), masked(self.lm.layers, self.mask):
            (dense,) = span_logits(self.lm.model, ids, None, span)
        return float(signals.token_kl(dense, sparse_logits).mean())

    def start(
        self, request: GenerationRequest, plan: SparsityPlan, cancelled: threading.Event
    ) -> Sequence:
        """A sequence for `request` under `plan`, not yet prefilled (`prefill`)."""
        ids, plain = self.encode(request)
        self.check_length(len(ids), request.max_new_tokens)
        fast = self._fast_for(plan, len(ids) + request.max_new_tokens)
        readout = self._readout(len(ids)) if request.readout else None
        return Sequence(self.lm, request, plan, ids, plain, cancelled, fast, readout)

    def passes(self, seq: Sequence) -> ExitStack:
        """What a reference-path forward pass of `seq` runs inside: the mask, the plan's hooks
        and the readout's (the fast path applies its plan and readout itself)."""
        stack = ExitStack()
        stack.enter_context(masked(self.lm.layers, self.mask))
        if seq.fast is None:
            stack.enter_context(sparsified(self.lm.layers, seq.plan, seq.recorder))
            if seq.readout is not None:
                stack.enter_context(read_out(self.lm.model, self.lm.layers, seq.readout))
        return stack

    def prefill(self, seq: Sequence) -> FastKV | ReferenceKV:
        """Run `seq`'s prompt (inside `passes`); its first logits are `seq.prefilled.logits`."""
        path, prefill, ends = self._prefill_of(seq)
        with seq.recorder.one_step() if seq.recorder is not None else nullcontext():
            seq.prefilled = prefill.run(seq.prompt_ids, ends)
        return path

    def open_prefill(self, seq: Sequence, stack: ExitStack) -> OpenPrefill:
        """`prefill` of a fast-path `seq` but for its last part, which the caller runs (packed
        with other prompts' last parts: `runtime.packed`) and hands to `OpenPrefill.close`;
        `stack` holds the recorder's single prefill step open until it closes."""
        path, prefill, ends = self._prefill_of(seq)
        if not isinstance(path, FastKV):
            raise ValueError("only a fast-path prefill runs packed")
        if seq.recorder is not None:
            stack.enter_context(seq.recorder.one_step())
        cached, mismatch, start = prefill.begin(seq.prompt_ids, ends)
        return OpenPrefill(path, prefill, cached, mismatch, start)

    def finish(
        self, seq: Sequence, drift: float | None = None, ended: float | None = None
    ) -> GenerationStats:
        """`seq`'s statistics; its drift is measured here unless given (a batched pass).
        `ended`: when its last token came, if before now (the drift pass is not decode time)."""
        ended = time.perf_counter() if ended is None else ended
        if drift is None and seq.request.measure_drift:
            found = seq.drift_input()
            drift = self.semantic_drift(*found) if found is not None else 0.0
        echo: tuple[list[float | None], list[TopLogprobs]] = ([], [])
        if seq.request.echo_logprobs:
            echo = self.prompt_logprobs(seq.prompt_ids, seq.plan, seq.request.top_logprobs)
        return seq.stats(drift, echo, ended)

    def semantic_drift_many(
        self, items: list[tuple[list[int], list[int], torch.Tensor]]
    ) -> list[float]:
        """`semantic_drift` of several answers (prompt, answer, sparse logits), in dense passes
        of answers of similar length (`length_groups`), each right-padded: the padding comes
        after every real position, so it changes none."""
        found = [0.0] * len(items)
        rows = [prompt + answer[:-1] for prompt, answer, _ in items]
        for group in length_groups([len(row) for row in rows]):
            if len(group) == 1:
                found[group[0]] = self.semantic_drift(*items[group[0]])
                continue
            width = max(len(rows[i]) for i in group)
            ids = torch.tensor([rows[i] + [0] * (width - len(rows[i])) for i in group])
            mask = torch.tensor([[1] * len(rows[i]) + [0] * (width - len(rows[i])) for i in group])
            spans = [(len(items[i][0]) - 1, len(items[i][0]) - 1 + len(items[i][1])) for i in group]
            with torch.inference_mode(), masked(self.lm.layers, self.mask):
                logits = span_logits(self.lm.model, ids, mask, spans)
            for i, dense in zip(group, logits, strict=True):
                found[i] = float(signals.token_kl(dense, items[i][2]).mean())
        return found

    def _stream(self, out: Generation, seq: Sequence) -> Iterator[str]:
        with torch.inference_mode(), self.passes(seq):
            path = self.prefill(seq)
            logits = seq.prefilled.logits
            while True:
                delta = seq.accept(logits)
                if delta:
                    yield delta
                if seq.done:
                    break
                if isinstance(path, ReferenceKV):
                    logits = path.forward([seq.token])
                else:
                    logits = path.step(seq.token)
        tail = seq.stream.flush()
        if tail:
            yield tail
        out.stats = self.finish(seq)

    @property
    def vocab_size(self) -> int:
        return int(self.lm.model.get_output_embeddings().weight.shape[0])

    def prompt_logprobs(
        self, ids: list[int], plan: SparsityPlan, top: int = 0
    ) -> tuple[list[float | None], list[TopLogprobs]]:
        """Each prompt token's log-probability given the tokens before it, under `plan` (one
        teacher-forced pass; None for the first token), and the `top` likeliest there."""
        with (
            torch.inference_mode(),
            masked(self.lm.layers, self.mask),
            sparsified(self.lm.layers, plan),
        ):
            logp = self.lm.model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
        logp = logp.log_softmax(-1)
        chosen = logp.gather(-1, torch.tensor(ids[1:]).reshape(-1, 1)).reshape(-1).tolist()
        tops: list[TopLogprobs] = [[]]
        if top:
            found = logp.topk(top)
            tops += [
                list(zip(i, v, strict=True))
                for i, v in zip(found.indices.tolist(), found.values.tolist(), strict=True)
            ]
        return [None, *chosen], tops if top else []

    def _readout(self, prompt_len: int, limit: int | None = None) -> Readout:
        cfg = self.lm.model.config
        width = int(cfg.hidden_size)
        return Readout(self.lm.num_layers, int(cfg.num_attention_heads), width, prompt_len, limit)

    def _fast_for(self, plan: SparsityPlan, tokens: int) -> FastDecoder | None:
        fast = self.fast
        if fast is None or self.mask is not None or not fast.supports(plan, tokens):
            return None
        return fast

    def _prefill_of(self, seq: Sequence) -> tuple[FastKV | ReferenceKV, Prefill[Any], list[int]]:
        """`seq`'s decode path, its prefill (reusing a cached prefix where one applies) and the
        ends of the prompt's parts (reusable prefixes, then the whole prompt)."""
        key, reuse = self._cache_key(seq.plan), seq.request.use_prefix_cache
        path: FastKV | ReferenceKV
        store: PrefixCache[Any] | None
        if seq.fast is None:
            path = ReferenceKV(self, seq.recorder, seq.readout)
            store = self.prefix_cache if reuse else None
        else:
            path = FastKV(seq.fast, seq.plan, seq.recorder, seq.readout)
            store = self.fast_prefixes if reuse else None
        ends = self._prefix_ends(seq.request, seq.prompt_ids) if reuse else []
        prefill: Prefill[Any] = Prefill(path, store, key, seq.recorder)
        return path, prefill, [*ends, len(seq.prompt_ids)]

    def _prefix_ends(self, request: GenerationRequest, prompt_ids: list[int]) -> list[int]:
        """Where a prefix later requests may share ends: the prompt without its last message
        (a system prompt, earlier turns), when its tokens begin the prompt's."""
        if request.messages is None or len(request.messages) < 2:
            return []
        text = self.lm.tokenizer.apply_chat_template(
            request.messages[:-1], tokenize=False, add_generation_prompt=False
        )
        head = self.encode_text(text)
        shared = 0 < len(head) < len(prompt_ids) and prompt_ids[: len(head)] == head
        return [len(head)] if shared else []

    def _cache_key(self, plan: SparsityPlan) -> CacheKey:
        # KV values depend on the mask too, so a masked engine keys its entries apart.
        model_id = (
            self.lm.model_id if self.mask is None else f"{self.lm.model_id}#{self.mask.digest()}"
        )
        return CacheKey(model_id, plan.calibration_version, plan.level.value)

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


def _plain(messages: list[Message]) -> str:
    return "\n".join(m["content"] for m in messages)


def _say_path(plan: SparsityPlan) -> None:
    if plan.gates is not None:
        log.info(
            "level %s serves learned gates %s on the reference path (the fast path runs "
            "threshold plans)",
            plan.level.value,
            plan.gates.version,
        )


def length_groups(lengths: list[int], waste: float = PADDING_WASTE) -> list[list[int]]:
    """Indices of `lengths` in groups of similar length, shortest first: a group grows while
    its padded size stays within `waste` times its real tokens. On CPU a padded pass costs
    what its padded tokens cost, so padding short rows to a long one is pure loss (a sparse
    baseline's drift passes mixed 20- and 200-token rows: 1.8x the real tokens)."""
    groups: list[list[int]] = []
    total = 0
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        n = lengths[i]
        if groups and (len(groups[-1]) + 1) * n <= waste * (total + n):
            groups[-1].append(i)
            total += n
        else:
            groups.append([i])
            total = n
    return groups
