"""One admitted request (`intake`) to its final statistics: generation (serve) or upstream
answer + probe (proxy), its trust, and the fallback action a low trust score takes."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

from opentelemetry.trace import SpanKind

from services.gateway.engine_thread import EngineJob, QueueFullError
from services.gateway.errors import ApiError
from services.gateway.fallback import ROUTES, route_action, simplified, with_passages
from services.gateway.intake import Prepared
from services.gateway.runtime import Runtime
from services.gateway.tracing import child_span, span_parent
from services.gateway.trust import Trust
from services.gateway.upstream import stream_upstream
from sparse_engine.calibration.store import CalibrationNotFoundError
from sparse_engine.runtime.generation import GenerationRequest, GenerationStats, Message
from sparse_engine.runtime.scoring import Probe

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Final:
    stats: GenerationStats
    trust: Trust
    queue_s: float
    engine_s: float = 0.0  # from joining the engine's batch to the last token, on its thread


@dataclass(frozen=True, slots=True)
class Answered:
    """An answer's statistics, as the engine worker returned them."""

    stats: GenerationStats
    queue_s: float
    engine_s: float


def final_headers(final: Final) -> dict[str, str]:
    signals = final.stats.signals
    return {
        "X-IR-Sparsity": f"{signals.sparsity_ratio:.4f}" if signals else "0",
        "X-IR-Trust": final.trust.header(),
        "X-First-Token-Latency": f"{final.stats.time_to_first_token_s * 1000:.1f}",
        "X-KV-Cache-Hit-Rate": f"{final.stats.cache_hit_rate:.4f}",
    }


def server_timing(finals: list[Final]) -> dict[str, str]:
    """The engine's part of a JSON response's time (W3C Server-Timing: waiting for the engine,
    then in its batch), so a caller can tell it from the guardrail's own time."""
    queue = sum(f.queue_s for f in finals) * 1000
    engine = sum(f.engine_s for f in finals) * 1000
    return {"Server-Timing": f"queue;dur={queue:.1f}, engine;dur={engine:.1f}"}


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
        with child_span(rt.tracing, p.span, "retrieve") as span:
            query = p.chat.user_text
            hits = await asyncio.to_thread(rt.knowledge.search, query, cfg.retrieve_passages)
            if span is not None:
                span.set_attribute("sparseguard.passages", len(hits))
        if hits:
            return with_passages(p.chat.messages, hits, cfg.passage_chars), action, len(hits)
        log.info("trace %s: the knowledge base found no passage; simplifying", p.trace_id)
    return simplified(p.chat.messages), "simplify", 0


async def _answer(
    rt: Runtime, p: Prepared, messages: list[Message] | None
) -> AsyncIterator[str | Final]:
    """One answer to `messages` (default: the request's), served or proxied, with its trust."""
    # A regenerated answer is not the route's first: the gateway's own models judge it.
    route = ROUTES[p.chat.endpoint] if messages is None else None
    messages = messages or p.chat.messages
    answers = (
        _proxy(rt, p, messages) if rt.settings.gateway.mode == "proxy" else _serve(rt, p, messages)
    )
    prompt = "\n".join(m["content"] for m in messages)
    system = any(m["role"] == "system" for m in messages)
    async for item in answers:
        if isinstance(item, Answered):
            trust = rt.trust.assess(
                item.stats, prompt, p.plan.is_dense, route, p.chat.user_text, system
            )
            yield Final(item.stats, trust, item.queue_s, item.engine_s)
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

    try:
        job = rt.worker.generate(request, p.plan)
    except QueueFullError:
        raise _queue_full(rt) from None
    async for item in _drain(job):
        yield item


async def _proxy(
    rt: Runtime, p: Prepared, messages: list[Message]
) -> AsyncIterator[str | Answered]:
    if rt.upstream is None:
        raise ApiError(502, "proxy mode is not configured with an upstream client")
    parts: list[str] = []
    first_at = None
    chat = replace(p.chat, messages=messages)
    upstream_model = rt.settings.gateway.upstream_model or chat.model
    with child_span(rt.tracing, p.span, f"chat {upstream_model}", SpanKind.CLIENT) as span:
        context = span_parent(span, p.traceparent).header()
        async for delta in stream_upstream(rt.upstream, rt.settings.gateway, chat, context):
            first_at = first_at or time.perf_counter()
            parts.append(delta)
            yield delta
        if span is not None:
            span.set_attributes({"gen_ai.operation.name": "chat", "server.address": _host(rt)})
    answer = "".join(parts)

    probe = Probe(messages, rt.engine.encode_text(answer), p.measure_drift, answer)
    try:
        job = rt.worker.probe(probe, p.plan, readout=True)
    except QueueFullError:
        raise _queue_full(rt) from None
    with child_span(rt.tracing, p.span, "probe") as span:
        async for item in _drain(job):
            if isinstance(item, Answered):
                item.stats.time_to_first_token_s = (first_at or time.perf_counter()) - p.started
                if span is not None:
                    span.set_attribute("sparseguard.probe_tokens", item.stats.completion_tokens)
            yield item


def _host(rt: Runtime) -> str:
    return urlsplit(rt.settings.gateway.upstream_url or "").hostname or ""


def _queue_full(rt: Runtime) -> ApiError:
    rt.metrics.rejections.inc()
    return ApiError(429, "the engine queue is full; retry shortly", {"Retry-After": "1"})


async def _drain(job: EngineJob) -> AsyncIterator[str | Answered]:
    try:
        async for kind, value in job.events():
            if kind == "delta":
                yield value
            elif kind == "error":
                raise _as_api_error(value)
            else:
                yield Answered(value, job.queue_s, job.engine_s)
    finally:
        job.cancel.set()  # a client that went away stops its generation


def _as_api_error(exc: BaseException) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, (ValueError, CalibrationNotFoundError)):
        return ApiError(400, str(exc))
    log.error("engine failure", exc_info=exc)
    return ApiError(500, "the engine failed on this request; see the gateway log")
