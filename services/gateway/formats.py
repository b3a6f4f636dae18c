"""Response bodies and stream events in each API's shape, with the `ir_stats` extension."""

from __future__ import annotations

import json
import time
from typing import Any, Protocol

from services.gateway.errors import ApiError, error_body
from services.gateway.pipeline import Final, Prepared

OPENAI_FINISH = {"stop": "stop", "length": "length", "cancelled": "stop"}
ANTHROPIC_STOP = {"stop": "end_turn", "length": "max_tokens", "cancelled": "end_turn"}


def ir_stats(p: Prepared, final: Final) -> dict[str, Any]:
    s, sig = final.stats, final.stats.signals
    return {
        "trace_id": p.trace_id,
        "level": p.decision.level.value,
        "calibration_version": p.calibration_version,
        "policy": list(p.decision.changes),
        "hygiene": list(p.hygiene_flags),
        "sparsity_ratio": sig.sparsity_ratio if sig else 0.0,
        "gate_confidence": sig.gate_confidence if sig else None,
        "activation_stability": sig.activation_stability_pct if sig else None,
        "semantic_drift_kl": s.semantic_drift_kl,
        "silence_rate_per_layer": sig.silence_rate_per_layer if sig else [],
        "trust": final.trust.score,
        "trust_action": final.trust.action,
        "time_to_first_token_ms": round(s.time_to_first_token_s * 1000, 1),
        "kv_cache_hit_rate": s.cache_hit_rate,
    }


def openai_body(p: Prepared, final: Final, text: str, model: str) -> dict[str, Any]:
    s = final.stats
    return {
        "id": f"chatcmpl-{p.trace_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": OPENAI_FINISH.get(s.finish_reason, "stop"),
            }
        ],
        "usage": _openai_usage(final),
        "ir_stats": ir_stats(p, final),
    }


def anthropic_body(p: Prepared, final: Final, text: str, model: str) -> dict[str, Any]:
    s = final.stats
    return {
        "id": f"msg_{p.trace_id}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": text}],
        "stop_reason": ANTHROPIC_STOP.get(s.finish_reason, "end_turn"),
        "stop_sequence": None,
        "usage": {"input_tokens": s.prompt_tokens, "output_tokens": s.completion_tokens},
        "ir_stats": ir_stats(p, final),
    }


class StreamFormat(Protocol):
    def start(self) -> bytes: ...
    def delta(self, text: str) -> bytes: ...
    def final(self, final: Final) -> bytes: ...
    def error(self, error: ApiError) -> bytes: ...


class OpenAIStream:
    def __init__(self, p: Prepared, model: str) -> None:
        self.p, self.model, self.created = p, model, int(time.time())

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        body = {
            "id": f"chatcmpl-{self.p.trace_id}",
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }
        return _sse(None, body)

    def start(self) -> bytes:
        return self._chunk(
            [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
        )

    def delta(self, text: str) -> bytes:
        return self._chunk([{"index": 0, "delta": {"content": text}, "finish_reason": None}])

    def final(self, final: Final) -> bytes:
        reason = OPENAI_FINISH.get(final.stats.finish_reason, "stop")
        last = self._chunk([{"index": 0, "delta": {}, "finish_reason": reason}])
        usage = self._chunk([], usage=_openai_usage(final), ir_stats=ir_stats(self.p, final))
        return last + usage + b"data: [DONE]\n\n"

    def error(self, error: ApiError) -> bytes:
        return _sse(None, error_body(False, error.status, error.message)) + b"data: [DONE]\n\n"


class AnthropicStream:
    def __init__(self, p: Prepared, model: str) -> None:
        self.p, self.model = p, model

    def start(self) -> bytes:
        message: dict[str, Any] = {
            "id": f"msg_{self.p.trace_id}",
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        block = {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "text", "text": ""},
        }
        return _sse("message_start", {"type": "message_start", "message": message}) + _sse(
            "content_block_start", block
        )

    def delta(self, text: str) -> bytes:
        body = {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "text_delta", "text": text},
        }
        return _sse("content_block_delta", body)

    def final(self, final: Final) -> bytes:
        s = final.stats
        delta = {
            "type": "message_delta",
            "delta": {
                "stop_reason": ANTHROPIC_STOP.get(s.finish_reason, "end_turn"),
                "stop_sequence": None,
            },
            "usage": {"input_tokens": s.prompt_tokens, "output_tokens": s.completion_tokens},
            "ir_stats": ir_stats(self.p, final),
        }
        return (
            _sse("content_block_stop", {"type": "content_block_stop", "index": 0})
            + _sse("message_delta", delta)
            + _sse("message_stop", {"type": "message_stop"})
        )

    def error(self, error: ApiError) -> bytes:
        return _sse("error", error_body(True, error.status, error.message))


def _openai_usage(final: Final) -> dict[str, int]:
    s = final.stats
    return {
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.completion_tokens,
        "total_tokens": s.prompt_tokens + s.completion_tokens,
    }


def _sse(event: str | None, body: dict[str, Any]) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(body, separators=(',', ':'))}\n\n".encode()
