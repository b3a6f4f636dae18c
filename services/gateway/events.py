"""Turn one finished (or failed) request into its telemetry event and metrics."""

from __future__ import annotations

import logging
import time
import uuid
from datetime import UTC, datetime
from typing import Any

from services.gateway.errors import ApiError
from services.gateway.fallback import ROUTES
from services.gateway.intake import Prepared, sampled_share
from services.gateway.pipeline import Final
from services.gateway.runtime import Runtime
from services.gateway.tracing import end_span
from services.telemetry.schema import EventError, TelemetryEvent

log = logging.getLogger(__name__)


def record(rt: Runtime, p: Prepared, final: Final | None, error: ApiError | None = None) -> None:
    """Send the request's event and update the gateway metrics. Never raises."""
    if error is not None:
        error.recorded = True
    try:
        event = build_event(rt, p, final, error)
        _observe(rt, p, final, error)
        end_span(p.span, span_attributes(rt, p, event), error.message if error else None)
        if rt.sink is not None:
            rt.sink.send(event)
    except Exception:
        log.exception("could not record telemetry for %s", p.trace_id)


def span_attributes(rt: Runtime, p: Prepared, event: TelemetryEvent) -> dict[str, Any]:
    """The request span's attributes: OpenTelemetry GenAI conventions, then sparseguard's."""
    chat = p.chat
    return {
        "gen_ai.operation.name": p.operation,
        "gen_ai.provider.name": "sparseguard",
        "gen_ai.request.model": chat.model or rt.engine.lm.model_id,
        "gen_ai.response.model": rt.engine.lm.model_id,
        "gen_ai.response.id": p.trace_id,
        "gen_ai.request.max_tokens": p.decision.max_tokens,
        "gen_ai.request.temperature": chat.temperature,
        "gen_ai.request.top_p": chat.top_p,
        "gen_ai.request.top_k": chat.top_k or None,
        "gen_ai.request.seed": chat.seed,
        "gen_ai.request.choice.count": chat.n if chat.n > 1 else None,
        "gen_ai.request.stop_sequences": list(chat.stop) or None,
        "gen_ai.request.stream": chat.stream,
        "gen_ai.usage.input_tokens": event.prompt_tokens,
        "gen_ai.usage.output_tokens": event.completion_tokens,
        "gen_ai.response.finish_reasons": [event.finish_reason] if event.finish_reason else None,
        "error.type": event.error.type if event.error else None,
        "sparseguard.mode": event.mode,
        "sparseguard.level": event.level,
        "sparseguard.calibration_version": event.calibration_version,
        "sparseguard.sparsity_ratio": event.sparsity_ratio,
        "sparseguard.gate_confidence": event.gate_confidence,
        "sparseguard.trust_score": event.trust_score,
        "sparseguard.trust_action": event.trust_action,
        "sparseguard.policy": event.policy_flags or None,
    }


def record_rejected(rt: Runtime, api: str, error: ApiError) -> None:
    """The event of a chat request refused before it was prepared (bad body, bad key)."""
    error.recorded = True
    mode = rt.settings.gateway.mode
    try:
        rt.metrics.requests.labels(api, mode, "none", str(error.status)).inc()
        if rt.sink is not None:
            rt.sink.send(
                TelemetryEvent(
                    trace_id=uuid.uuid4().hex,
                    time=datetime.now(UTC),
                    model=rt.engine.lm.model_id,
                    calibration_version=None,
                    level="none",
                    mode=mode,
                    api="anthropic" if api == "anthropic" else "openai",
                    status="error",
                    error=EventError(type=str(error.status), message=error.message),
                )
            )
    except Exception:
        log.exception("could not record a rejected request")


def build_event(
    rt: Runtime, p: Prepared, final: Final | None, error: ApiError | None
) -> TelemetryEvent:
    stats = final.stats if final else None
    sig = stats.signals if stats else None
    total_ms = (time.perf_counter() - p.started) * 1000
    return TelemetryEvent(
        trace_id=p.trace_id,
        time=p.started_at,
        model=rt.engine.lm.model_id,
        calibration_version=p.calibration_version,
        level=p.decision.level.value,
        mode=rt.settings.gateway.mode,
        api=p.chat.api,
        status="error" if error else "ok",
        finish_reason=stats.finish_reason if stats else None,
        prompt_tokens=stats.prompt_tokens if stats else 0,
        completion_tokens=stats.completion_tokens if stats else 0,
        sparsity_ratio=sig.sparsity_ratio if sig else None,
        sparsity_per_layer=sig.sparsity_per_layer if sig else [],
        gate_confidence=sig.gate_confidence if sig else None,
        activation_stability_pct=sig.activation_stability_pct if sig else None,
        silence_rate_per_layer=sig.silence_rate_per_layer if sig else [],
        gate_entropy=sig.gate_entropy if sig else None,
        input_entropy_bits_per_char=stats.input_entropy_bits_per_char if stats else None,
        semantic_drift_kl=stats.semantic_drift_kl if stats else None,
        ttft_ms=stats.time_to_first_token_s * 1000 if stats else None,
        total_ms=total_ms,
        queue_ms=final.queue_s * 1000 if final else None,
        batch_size=stats.batch_size if stats else None,
        decode_tokens_per_s=stats.decode_tokens_per_s if stats else None,
        cache_hit_rate=stats.cache_hit_rate if stats else None,
        trust_score=final.trust.score if final else None,
        trust_action=final.trust.action if final else None,
        trust_reasons=list(final.trust.reasons) if final else [],
        trust_first_score=final.trust.first_score if final else None,
        mean_token_logprob=_mean(stats.token_logprobs) if stats else None,
        mean_token_entropy=_mean(stats.token_entropies) if stats else None,
        policy_flags=list(p.decision.changes),
        hygiene_flags=list(p.hygiene_flags),
        error=EventError(type=str(error.status), message=error.message) if error else None,
        prompt_text=_kept_prompt(rt, p) if error is None else None,
        end_user=p.chat.end_user,
        traceparent=p.traceparent.header(),
    )


def _kept_prompt(rt: Runtime, p: Prepared) -> str | None:
    """The cleaned prompt, for a sampled share of requests, only when the operator opted in."""
    cfg = rt.settings.telemetry
    if not cfg.keep_prompt_text or not sampled_share(p.trace_id, cfg.prompt_sample_rate, "p"):
        return None
    return "\n\n".join(m["content"] for m in p.chat.messages if m["content"].strip())


def _observe(rt: Runtime, p: Prepared, final: Final | None, error: ApiError | None) -> None:
    m = rt.metrics
    mode, level = rt.settings.gateway.mode, p.decision.level.value
    status = str(error.status) if error else "ok"
    m.requests.labels(p.chat.api, mode, level, status).inc()
    m.duration.labels(p.chat.api, mode).observe(time.perf_counter() - p.started)
    for change in p.decision.changes:
        m.policy_changes.labels(change.split(":", 1)[0]).inc()
    if final is None:
        return
    stats = final.stats
    m.ttft.labels(mode).observe(stats.time_to_first_token_s)
    m.queue_wait.observe(final.queue_s)
    m.batch_size.observe(stats.batch_size)
    m.tokens.labels("prompt").inc(stats.prompt_tokens)
    m.tokens.labels("completion").inc(stats.completion_tokens)
    m.cache_tokens.labels("hit").inc(stats.cached_tokens)
    m.cache_tokens.labels("miss").inc(stats.prompt_tokens - stats.cached_tokens)
    if stats.cache_mismatch:
        m.cache_mismatches.inc()
    if stats.signals is not None:
        m.sparsity.labels(level).observe(stats.signals.sparsity_ratio)
    trust = final.trust
    m.trust_score.labels(level).observe(
        trust.score if trust.first_score is None else trust.first_score
    )
    m.trust_actions.labels(trust.action, ROUTES[p.chat.endpoint]).inc()
    for reason in trust.reasons:
        m.trust_reasons.labels(reason).inc()


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None
