"""One chat request from cleaned input to final statistics: hygiene, policy, generation
(serve) or upstream answer + probe (proxy), trust, telemetry."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
import zlib
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from services.gateway.engine_thread import Emit, EngineJob, JobFn, QueueFullError
from services.gateway.errors import ApiError
from services.gateway.fallback import route_action, simplified, with_passages
from services.gateway.hygiene import clean_text
from services.gateway.inputs import ChatInput
from services.gateway.policy import (
    AGGRESSIVE_MAX_TOKENS,
    PolicyDecision,
    PolicyInput,
    decide,
    header_value,
)
from services.gateway.runtime import Runtime
from services.gateway.trust import Trust
from services.gateway.upstream import stream_upstream
from sparse_engine.calibration.store import CalibrationNotFoundError
from sparse_engine.runtime.generation import GenerationRequest, GenerationStats, Message
from sparse_engine.runtime.scoring import score_answer
from sparse_engine.sparsity.plan import Level, SparsityPlan

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Prepared:
    """A request admitted under `plan`, pinned here so that it runs, is labelled and is
    reported under one calibration even when a new one is installed while it waits or runs."""

    chat: ChatInput
    decision: PolicyDecision
    hygiene_flags: tuple[str, ...]
    trace_id: str
    plan: SparsityPlan
    measure_drift: bool
    started: float
    started_at: datetime

    @property
    def calibration_version(self) -> str | None:
        return self.plan.calibration_version


@dataclass(frozen=True, slots=True)
class Final:
    stats: GenerationStats
    trust: Trust
    queue_s: float


@dataclass(frozen=True, slots=True)
class Answered:
    """An answer's statistics, as the engine worker returned them."""

    stats: GenerationStats
    queue_s: float


def prepare(rt: Runtime, chat: ChatInput) -> Prepared:
    """Clean the text and apply the policy; raises ApiError(400) for bad levels."""
    _check_model(rt, chat.model)
    chat = _checked_for_mode(rt, chat)
    trace_id = uuid.uuid4().hex
    flags: list[str] = []
    messages = []
    for message in chat.messages:
        cleaned = clean_text(message["content"])
        flags.extend(f for f in cleaned.flags if f not in flags)
        # A raw prompt goes to the model verbatim (its log-probabilities are what the caller
        # scores); its hygiene findings are still reported.
        text = message["content"] if chat.raw else cleaned.text
        messages.append({"role": message["role"], "content": text})
    if not any(m["content"].strip() for m in messages if m["role"] != "system"):
        raise ApiError(400, "messages: at least one non-system message with text is required")
    chat = replace(chat, messages=messages)
    decision = _decide(rt, chat)
    plan = _pin_plan(rt, decision.level)
    rate = rt.settings.engine.drift_sample_rate
    sampled = sampled_share(trace_id, rate)
    now = datetime.now(UTC)
    return Prepared(chat, decision, tuple(flags), trace_id, plan, sampled, time.perf_counter(), now)


def choices(p: Prepared) -> list[Prepared]:
    """One prepared request per choice asked for (`n`): each its own generation and its own
    telemetry event (trace ids `<trace>-1`, `<trace>-2`, ...; a seed advances by one)."""
    chat = p.chat
    return [p] + [
        replace(
            p,
            trace_id=f"{p.trace_id}-{i}",
            chat=replace(chat, seed=None if chat.seed is None else chat.seed + i),
        )
        for i in range(1, chat.n)
    ]


def _checked_for_mode(rt: Runtime, chat: ChatInput) -> ChatInput:
    """A token-id prompt gets its text; proxy mode refuses what it cannot relay."""
    if chat.prompt_ids is not None:
        vocab = rt.engine.vocab_size
        if max(chat.prompt_ids) >= vocab:
            raise ApiError(
                400,
                f"prompt: token id {max(chat.prompt_ids)} is outside the "
                f"vocabulary of {rt.engine.lm.model_id} (0-{vocab - 1})",
            )
        text = rt.engine.lm.tokenizer.decode(chat.prompt_ids)
        chat = replace(chat, messages=[{"role": "user", "content": text}], prompt=text)
    if rt.settings.gateway.mode != "proxy":
        return chat
    refused = {
        "/v1/completions": chat.raw,
        "n": chat.n > 1,
        "logprobs": chat.logprobs,
        "top_k": chat.top_k > 0,
    }
    for name, asked in refused.items():
        if asked:
            raise ApiError(
                400,
                f"{name}: not available in proxy mode, which relays one text answer from the "
                "upstream chat API and probes it (serve mode offers it)",
            )
    return chat


def sampled_share(trace_id: str, rate: float, salt: str = "") -> bool:
    """A stable pseudo-random choice of `rate` of the requests, by trace id."""
    return zlib.crc32((salt + trace_id).encode()) % 10_000 < rate * 10_000


def upfront_headers(p: Prepared) -> dict[str, str]:
    return {
        "X-IR-Trace-ID": p.trace_id,
        "X-IR-Level": p.decision.level.value,
        "X-IR-Calibration": p.calibration_version or "none",
        "X-IR-Policy": header_value(p.decision.changes),
    }


def final_headers(final: Final) -> dict[str, str]:
    signals = final.stats.signals
    return {
        "X-IR-Sparsity": f"{signals.sparsity_ratio:.4f}" if signals else "0",
        "X-IR-Trust": final.trust.header(),
        "X-First-Token-Latency": f"{final.stats.time_to_first_token_s * 1000:.1f}",
        "X-KV-Cache-Hit-Rate": f"{final.stats.cache_hit_rate:.4f}",
    }


async def execute(rt: Runtime, p: Prepared) -> AsyncGenerator[str | Final, None]:
    """Text deltas, then one Final. Raises ApiError (429, 400, 502, 504)."""
    timeout = rt.settings.gateway.request_timeout_s
    try:
        async with asyncio.timeout(timeout):
            action = route_action(rt.settings, p.chat)
            answers = _guarded(rt, p, action) if action != "flag" else _answer(rt, p, None)
            async for item in answers:
                yield item
    except TimeoutError:
        raise ApiError(504, f"the request did not finish within {timeout:g} s") from None


async def _guarded(rt: Runtime, p: Prepared, action: str) -> AsyncIterator[str | Final]:
    """Hold the answer back until its trust is known; on low trust, regenerate it once with
    the route's action and send that one instead."""
    parts, first = await _buffered(_answer(rt, p, None))
    if first.trust.low:
        messages, action, passages = await _fallback(rt, p, action)
        parts, final = await _buffered(_answer(rt, p, messages))
        first = replace(final, trust=first.trust.acted(action, final.trust, passages))
    for part in parts:
        yield part
    yield first


async def _buffered(items: AsyncIterator[str | Final]) -> tuple[list[str], Final]:
    parts: list[str] = []
    async for item in items:
        if isinstance(item, Final):
            return parts, item
        parts.append(item)
    raise ApiError(500, "generation ended without statistics")


async def _fallback(rt: Runtime, p: Prepared, action: str) -> tuple[list[Message], str, int]:
    """The regenerated prompt: with knowledge-base passages (simplified instead when the
    knowledge base finds none), or simplified."""
    cfg = rt.settings.trust
    if action == "retrieve":
        hits = await asyncio.to_thread(rt.knowledge.search, p.chat.user_text, cfg.retrieve_passages)
        if hits:
            return with_passages(p.chat.messages, hits, cfg.passage_chars), action, len(hits)
        log.info("trace %s: the knowledge base found no passage; simplifying", p.trace_id)
    return simplified(p.chat.messages), "simplify", 0


async def _answer(
    rt: Runtime, p: Prepared, messages: list[Message] | None
) -> AsyncIterator[str | Final]:
    """One answer to `messages` (default: the request's), served or proxied, with its trust."""
    messages = messages or p.chat.messages
    answers = (
        _proxy(rt, p, messages) if rt.settings.gateway.mode == "proxy" else _serve(rt, p, messages)
    )
    prompt = "\n".join(m["content"] for m in messages)
    async for item in answers:
        if isinstance(item, Answered):
            trust = rt.trust.assess(item.stats, prompt, p.plan.is_dense)
            yield Final(item.stats, trust, item.queue_s)
        else:
            yield item


async def _serve(
    rt: Runtime, p: Prepared, messages: list[Message]
) -> AsyncIterator[str | Answered]:
    chat = p.chat
    request = GenerationRequest(
        messages=None if chat.raw else messages,
        prompt=chat.prompt if chat.prompt_ids is None else None,
        prompt_ids=chat.prompt_ids,
        max_new_tokens=p.decision.max_tokens,
        temperature=p.decision.temperature,
        top_p=chat.top_p,
        top_k=chat.top_k,
        stop=chat.stop,
        seed=chat.seed,
        presence_penalty=chat.presence_penalty,
        frequency_penalty=chat.frequency_penalty,
        logit_bias=chat.logit_bias,
        top_logprobs=chat.top_logprobs,
        echo_logprobs=chat.echo and chat.logprobs,
        measure_drift=p.measure_drift,
        readout=True,  # what the trust model reads (`sparsity.readout`)
    )

    def run(emit: Emit, cancel: threading.Event) -> GenerationStats:
        generation = rt.engine.generate(request, p.plan)
        for delta in generation:
            emit(delta)
            if cancel.is_set():
                generation.cancel()
        return generation.result()

    async for item in _drain(_submit(rt, run)):
        yield item


def _check_model(rt: Runtime, model: str) -> None:
    """Serve mode answers only for the model it serves (an empty name means that one); in
    proxy mode the name is the upstream's to judge."""
    served = rt.engine.lm.model_id
    if rt.settings.gateway.mode == "proxy" or model in ("", served):
        return
    raise ApiError(
        404,
        f"model: {model!r} is not served here; this gateway serves {served!r} (GET /v1/models)",
        code="model_not_found",
    )


async def _proxy(
    rt: Runtime, p: Prepared, messages: list[Message]
) -> AsyncIterator[str | Answered]:
    if rt.upstream is None:
        raise ApiError(502, "proxy mode is not configured with an upstream client")
    parts: list[str] = []
    first_at = None
    chat = replace(p.chat, messages=messages)
    async for delta in stream_upstream(rt.upstream, rt.settings.gateway, chat):
        first_at = first_at or time.perf_counter()
        parts.append(delta)
        yield delta
    answer = "".join(parts)

    def run(emit: Emit, cancel: threading.Event) -> GenerationStats:
        return score_answer(rt.engine, messages, answer, p.plan, p.measure_drift, readout=True)

    async for item in _drain(_submit(rt, run)):
        if isinstance(item, Answered):
            item.stats.time_to_first_token_s = (first_at or time.perf_counter()) - p.started
        yield item


def _submit(rt: Runtime, run: JobFn) -> EngineJob:
    try:
        return rt.worker.submit(run)
    except QueueFullError:
        rt.metrics.rejections.inc()
        raise ApiError(
            429, "the engine queue is full; retry shortly", {"Retry-After": "1"}
        ) from None


async def _drain(job: EngineJob) -> AsyncIterator[str | Answered]:
    try:
        async for kind, value in job.events():
            if kind == "delta":
                yield value
            elif kind == "error":
                raise _as_api_error(value)
            else:
                yield Answered(value, job.queue_s)
    finally:
        job.cancel.set()  # a client that went away stops its generation


def _as_api_error(exc: BaseException) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, (ValueError, CalibrationNotFoundError)):
        return ApiError(400, str(exc))
    log.error("engine failure", exc_info=exc)
    return ApiError(500, "the engine failed on this request; see the gateway log")


def _decide(rt: Runtime, chat: ChatInput) -> PolicyDecision:
    cfg = rt.settings
    proxy = cfg.gateway.mode == "proxy"
    if chat.max_tokens is not None and chat.max_tokens > cfg.gateway.max_tokens_limit:
        raise ApiError(400, f"max_tokens must be at most {cfg.gateway.max_tokens_limit}")
    try:
        return decide(
            PolicyInput(
                user_text=chat.user_text,
                system_text=chat.system_text,
                requested_level=chat.ir_sparse_level,
                ir_sparse=chat.ir_sparse,
                max_tokens=chat.max_tokens,
                temperature=chat.temperature,
                default_level=cfg.engine.default_level,
                # In proxy mode the upstream samples with the caller's own settings: no policy
                # on temperature or length applies, and none is reported.
                raise_zero_temperature=cfg.gateway.raise_zero_temperature and not proxy,
                aggressive_max_tokens=cfg.gateway.max_tokens_limit
                if proxy
                else AGGRESSIVE_MAX_TOKENS,
            )
        )
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None


def _pin_plan(rt: Runtime, level: Level) -> SparsityPlan:
    try:
        return rt.engine.plan(level)
    except CalibrationNotFoundError:
        raise ApiError(400, f"level '{level.value}' is not calibrated on this gateway") from None
