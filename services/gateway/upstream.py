"""Proxy mode: stream an answer from an upstream OpenAI-compatible API."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

import httpx

from services.config import GatewaySettings
from services.gateway.errors import ApiError
from services.gateway.inputs import ChatInput

log = logging.getLogger(__name__)


async def stream_upstream(
    client: httpx.AsyncClient, settings: GatewaySettings, chat: ChatInput, traceparent: str
) -> AsyncIterator[str]:
    """Text deltas of the upstream answer, asked for within the request's trace (W3C
    `traceparent`). Upstream failures become 502, time-outs 504."""
    if not settings.upstream_url:
        raise ApiError(502, "proxy mode needs an upstream URL (SPARSEGUARD_GATEWAY__UPSTREAM_URL)")
    url = settings.upstream_url.rstrip("/") + "/chat/completions"
    headers = {"accept": "text/event-stream", "traceparent": traceparent}
    if settings.upstream_api_key is not None:
        headers["authorization"] = f"Bearer {settings.upstream_api_key.get_secret_value()}"
    body = {
        "model": settings.upstream_model or chat.model or "default",
        "messages": chat.messages,
        "stream": True,
        **_sampling(chat),
    }
    try:
        async with client.stream(
            "POST", url, json=body, headers=headers, timeout=settings.upstream_timeout_s
        ) as response:
            if response.status_code >= 400:
                detail = (await response.aread()).decode("utf-8", "replace")[:300]
                raise ApiError(502, f"upstream returned HTTP {response.status_code}: {detail}")
            async for line in response.aiter_lines():
                delta = _delta(line)
                if delta is None:
                    return
                if delta:
                    yield delta
    except httpx.TimeoutException:
        raise ApiError(
            504, f"upstream did not answer within {settings.upstream_timeout_s:g} s"
        ) from None
    except httpx.HTTPError as exc:
        raise ApiError(502, f"upstream unreachable ({type(exc).__name__})") from None


def _sampling(chat: ChatInput) -> dict[str, object]:
    """The caller's own sampling fields, as sent: the sparse level's policy (a temperature
    raise, the aggressive max_tokens cap) shapes this gateway's probe, never the upstream's
    answer. Fields left out stay out, so the upstream's defaults apply; the end-user id goes
    as the hash this gateway keeps of it."""
    fields: dict[str, object] = {
        "max_tokens": chat.max_tokens,
        "temperature": chat.temperature,
        "top_p": chat.top_p if chat.top_p < 1.0 else None,
        "stop": list(chat.stop) or None,
        "seed": chat.seed,
        "presence_penalty": chat.presence_penalty or None,
        "frequency_penalty": chat.frequency_penalty or None,
        "logit_bias": {str(k): v for k, v in chat.logit_bias.items()} or None,
        "user": chat.end_user,
    }
    return {name: value for name, value in fields.items() if value is not None}


def _delta(line: str) -> str | None:
    """Text of one SSE line; "" for lines without text, None at the end of the stream."""
    if not line.startswith("data:"):
        return ""
    data = line[5:].strip()
    if data == "[DONE]":
        return None
    try:
        chunk = json.loads(data)
        choices = chunk.get("choices") or [{}]
        return str((choices[0].get("delta") or {}).get("content") or "")
    except (ValueError, AttributeError, TypeError, IndexError):
        raise ApiError(502, "upstream sent a malformed stream chunk") from None
