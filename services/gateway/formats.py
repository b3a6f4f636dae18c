"""Response bodies and stream events in each endpoint's shape, with the `ir_stats` extension:
OpenAI chat completions and legacy completions (`n` choices each, log-probabilities when
asked) and Anthropic messages."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from services.gateway.errors import ApiError, error_body
from services.gateway.intake import Prepared
from services.gateway.logprobs import TokenText, chat_logprobs, completion_logprobs
from services.gateway.pipeline import Final

OPENAI_FINISH = {"stop": "stop", "length": "length", "cancelled": "stop"}
ANTHROPIC_STOP = {"stop": "end_turn", "length": "max_tokens", "cancelled": "end_turn"}


@dataclass(frozen=True, slots=True)
class Choice:
    """One generated answer of a request."""

    p: Prepared
    final: Final
    text: str

    @property
    def stats(self) -> dict[str, Any]:
        return ir_stats(self.p, self.final)


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


def openai_body(choices: list[Choice], model: str, token_text: TokenText) -> dict[str, Any]:
    return _openai_envelope(
        "chat.completion",
        "chatcmpl",
        choices,
        model,
        lambda c: {
            "message": {"role": "assistant", "content": c.text},
            "logprobs": _chat_logprobs(c, token_text),
        },
    )


def completion_body(choices: list[Choice], model: str, token_text: TokenText) -> dict[str, Any]:
    """A legacy completion: with `echo` the text (and log-probabilities) begin with the
    prompt's."""
    return _openai_envelope(
        "text_completion",
        "cmpl",
        choices,
        model,
        lambda c: {
            "text": _echoed(c.p) + c.text,
            "logprobs": _completion_logprobs(c, token_text),
        },
    )


def _openai_envelope(
    kind: str,
    prefix: str,
    choices: list[Choice],
    model: str,
    content: Callable[[Choice], dict[str, Any]],
) -> dict[str, Any]:
    first = choices[0]
    return {
        "id": f"{prefix}-{first.p.trace_id}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": i,
                **content(c),
                "finish_reason": _finish(c.final),
                **({"ir_stats": c.stats} if len(choices) > 1 else {}),
            }
            for i, c in enumerate(choices)
        ],
        "usage": _openai_usage(choices),
        "ir_stats": first.stats,
    }


def anthropic_body(choices: list[Choice], model: str, _: TokenText) -> dict[str, Any]:
    c = choices[0]
    s = c.final.stats
    return {
        "id": f"msg_{c.p.trace_id}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": c.text}],
        "stop_reason": ANTHROPIC_STOP.get(s.finish_reason, "end_turn"),
        "stop_sequence": None,
        "usage": {"input_tokens": s.prompt_tokens, "output_tokens": s.completion_tokens},
        "ir_stats": c.stats,
    }


class StreamFormat(Protocol):
    """Events of a stream: each choice in turn (start, deltas, finish), then the end."""

    def start(self, index: int, p: Prepared) -> bytes: ...
    def delta(self, index: int, text: str) -> bytes: ...
    def finish(self, index: int, choice: Choice) -> bytes: ...
    def end(self, choices: list[Choice]) -> bytes: ...
    def error(self, error: ApiError) -> bytes: ...


class OpenAIStream:
    """Chat completion chunks. Each choice's last chunk carries its finish reason, its
    log-probabilities (when asked) and its `ir_stats`; usage comes in a last chunk of its own
    when `stream_options.include_usage` asks for it."""

    def __init__(self, p: Prepared, model: str, token_text: TokenText) -> None:
        self.p, self.model, self.token_text = p, model, token_text
        self.created = int(time.time())
        self.object, self.prefix = "chat.completion.chunk", "chatcmpl"

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        body = {
            "id": f"{self.prefix}-{self.p.trace_id}",
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }
        return _sse(None, body)

    def start(self, index: int, p: Prepared) -> bytes:
        delta = {"role": "assistant", "content": ""}
        return self._chunk([{"index": index, "delta": delta, "finish_reason": None}])

    def delta(self, index: int, text: str) -> bytes:
        return self._chunk([{"index": index, "delta": {"content": text}, "finish_reason": None}])

    def finish(self, index: int, choice: Choice) -> bytes:
        last = {
            "index": index,
            "delta": {},
            "logprobs": _chat_logprobs(choice, self.token_text),
            "finish_reason": _finish(choice.final),
        }
        return self._chunk([last], ir_stats=choice.stats)

    def end(self, choices: list[Choice]) -> bytes:
        usage = self._chunk([], usage=_openai_usage(choices)) if self.p.chat.include_usage else b""
        return usage + b"data: [DONE]\n\n"

    def error(self, error: ApiError) -> bytes:
        return _sse(None, error_body(False, error.status, error.message)) + b"data: [DONE]\n\n"


class CompletionStream(OpenAIStream):
    """Legacy completion chunks (`text_completion`); with `echo` the first one is the prompt."""

    def __init__(self, p: Prepared, model: str, token_text: TokenText) -> None:
        super().__init__(p, model, token_text)
        self.object, self.prefix = "text_completion", "cmpl"

    def _text(self, index: int, text: str, **extra: Any) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": None} | extra

    def start(self, index: int, p: Prepared) -> bytes:
        return self._chunk([self._text(index, _echoed(p))])

    def delta(self, index: int, text: str) -> bytes:
        return self._chunk([self._text(index, text)])

    def finish(self, index: int, choice: Choice) -> bytes:
        last = self._text(
            index,
            "",
            logprobs=_completion_logprobs(choice, self.token_text),
            finish_reason=_finish(choice.final),
        )
        return self._chunk([last], ir_stats=choice.stats)


class AnthropicStream:
    def __init__(self, p: Prepared, model: str, _: TokenText) -> None:
        self.p, self.model = p, model

    def start(self, index: int, p: Prepared) -> bytes:
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

    def delta(self, index: int, text: str) -> bytes:
        body = {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "text_delta", "text": text},
        }
        return _sse("content_block_delta", body)

    def finish(self, index: int, choice: Choice) -> bytes:
        s = choice.final.stats
        delta = {
            "type": "message_delta",
            "delta": {
                "stop_reason": ANTHROPIC_STOP.get(s.finish_reason, "end_turn"),
                "stop_sequence": None,
            },
            "usage": {"input_tokens": s.prompt_tokens, "output_tokens": s.completion_tokens},
            "ir_stats": choice.stats,
        }
        return (
            _sse("content_block_stop", {"type": "content_block_stop", "index": 0})
            + _sse("message_delta", delta)
            + _sse("message_stop", {"type": "message_stop"})
        )

    def end(self, choices: list[Choice]) -> bytes:
        return b""

    def error(self, error: ApiError) -> bytes:
        return _sse("error", error_body(True, error.status, error.message))


def _echoed(p: Prepared) -> str:
    return (p.chat.prompt or "") if p.chat.echo else ""


def _finish(final: Final) -> str:
    return OPENAI_FINISH.get(final.stats.finish_reason, "stop")


def _chat_logprobs(c: Choice, token_text: TokenText) -> dict[str, Any] | None:
    return chat_logprobs(c.final.stats, token_text) if c.p.chat.logprobs else None


def _completion_logprobs(c: Choice, token_text: TokenText) -> dict[str, Any] | None:
    if not c.p.chat.logprobs:
        return None
    chars = len(c.p.chat.prompt or "")
    return completion_logprobs(c.final.stats, token_text, c.p.chat.echo, chars)


def _openai_usage(choices: list[Choice]) -> dict[str, int]:
    """Prompt tokens once per prompt, completion tokens summed over the choices."""
    prompts = {c.p.trace_id.split("-")[0]: c.final.stats.prompt_tokens for c in choices}
    prompt = sum(prompts.values())
    completion = sum(c.final.stats.completion_tokens for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _sse(event: str | None, body: dict[str, Any]) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(body, separators=(',', ':'))}\n\n".encode()
