"""A request admitted: its model and mode checked, text cleaned, policy applied, plan pinned,
trace context set (the caller's trace id, an OTLP span when export is on), one per choice."""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from opentelemetry.sdk.trace import Span

from services.gateway.errors import ApiError
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
from services.gateway.tracing import TraceParent, span_parent
from sparse_engine.calibration.store import CalibrationNotFoundError
from sparse_engine.sparsity.plan import Level, SparsityPlan


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
    traceparent: TraceParent  # this request's own trace context (the caller's trace id)
    span: Span | None = None  # its OTLP span, when export is on

    @property
    def operation(self) -> str:
        return "text_completion" if self.chat.raw else "chat"

    @property
    def calibration_version(self) -> str | None:
        return self.plan.calibration_version


def prepare(rt: Runtime, chat: ChatInput, caller: TraceParent | None = None) -> Prepared:
    """Clean the text and apply the policy; raises ApiError(400) for bad levels. `caller`:
    the incoming trace context, whose trace id becomes the request's."""
    _check_model(rt, chat.model)
    chat = _checked_for_mode(rt, chat)
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
    own = caller.child() if caller is not None else TraceParent.new()
    span = None
    if rt.tracing is not None:  # admitted: from here on the span is ended when it is recorded
        operation = "text_completion" if chat.raw else "chat"
        span = rt.tracing.request_span(f"{operation} {chat.model or rt.engine.lm.model_id}", caller)
        own = span_parent(span, own)
    sampled = sampled_share(own.trace_id, rt.settings.engine.drift_sample_rate)
    now, started = datetime.now(UTC), time.perf_counter()
    flagged = tuple(flags)
    return Prepared(chat, decision, flagged, own.trace_id, plan, sampled, started, now, own, span)


def choices(rt: Runtime, p: Prepared) -> list[Prepared]:
    """One prepared request per choice asked for (`n`): each its own generation, telemetry
    event and span (trace ids `<trace>-1`, `<trace>-2`, ...; a seed advances by one)."""
    chat = p.chat
    more = []
    for i in range(1, chat.n):
        span = None
        if rt.tracing is not None:
            name = f"{p.operation} {chat.model or rt.engine.lm.model_id} choice {i}"
            span = rt.tracing.request_span(name, p.traceparent)
        more.append(
            replace(
                p,
                trace_id=f"{p.trace_id}-{i}",
                chat=replace(chat, seed=None if chat.seed is None else chat.seed + i),
                span=span,
                traceparent=span_parent(span, p.traceparent),
            )
        )
    return [p, *more]


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
