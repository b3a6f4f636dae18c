"""Run a prepared request to a JSON response or an SSE stream; record it either way."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.gateway.errors import ApiError
from services.gateway.events import record
from services.gateway.formats import StreamFormat
from services.gateway.pipeline import Final, Prepared, execute, final_headers, upfront_headers
from services.gateway.runtime import Runtime

Body = Callable[[Prepared, Final, str, str], dict[str, Any]]
DISCONNECT_POLL_S = 0.25


async def respond_json(rt: Runtime, p: Prepared, request: Request, body: Body) -> JSONResponse:
    task = asyncio.create_task(_collect(rt, p))
    while not task.done():
        await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if not task.done() and await request.is_disconnected():
            task.cancel()  # cancels the generation; the client is gone
            record(rt, p, None, ApiError(499, "client disconnected"))
            return JSONResponse({}, status_code=499)
    text, final = task.result()
    headers = upfront_headers(p) | final_headers(final)
    return JSONResponse(body(p, final, text, rt.engine.lm.model_id), headers=headers)


async def respond_stream(rt: Runtime, p: Prepared, fmt: StreamFormat) -> StreamingResponse:
    """Errors before the first token become HTTP errors; later ones an error event."""
    items = execute(rt, p)
    try:
        first = await anext(items)
    except ApiError as error:
        record(rt, p, None, error)
        raise
    return StreamingResponse(
        _events(rt, p, fmt, first, items),
        media_type="text/event-stream",
        headers=upfront_headers(p) | {"Cache-Control": "no-cache"},
    )


async def _collect(rt: Runtime, p: Prepared) -> tuple[str, Final]:
    parts: list[str] = []
    try:
        async for item in execute(rt, p):
            if isinstance(item, Final):
                record(rt, p, item)
                return "".join(parts), item
            parts.append(item)
    except ApiError as error:
        record(rt, p, None, error)
        raise
    raise ApiError(500, "generation ended without statistics")


async def _events(
    rt: Runtime,
    p: Prepared,
    fmt: StreamFormat,
    first: str | Final,
    items: AsyncGenerator[str | Final, None],
) -> AsyncIterator[bytes]:
    yield fmt.start()
    final: Final | None = None
    try:
        async for item in _prepend(first, items):
            if isinstance(item, Final):
                final = item
                yield fmt.final(item)
            else:
                yield fmt.delta(item)
        record(rt, p, final)
    except ApiError as error:
        record(rt, p, final, error)
        yield fmt.error(error)
    except asyncio.CancelledError:
        record(rt, p, final, ApiError(499, "client disconnected"))
        raise
    finally:
        await items.aclose()


async def _prepend(
    first: str | Final, items: AsyncIterator[str | Final]
) -> AsyncIterator[str | Final]:
    yield first
    async for item in items:
        yield item
