"""Run a request's prepared choices, one after the other, to a JSON response or an SSE stream;
record each either way."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.gateway.errors import ApiError
from services.gateway.events import record
from services.gateway.formats import Choice, StreamFormat
from services.gateway.intake import Prepared, upfront_headers
from services.gateway.logprobs import TokenText
from services.gateway.pipeline import Final, execute, final_headers, server_timing
from services.gateway.runtime import Runtime

Body = Callable[[list[Choice], str, TokenText], dict[str, Any]]
DISCONNECT_POLL_S = 0.25


def token_text(rt: Runtime) -> TokenText:
    tokenizer = rt.engine.lm.tokenizer
    return lambda token: str(tokenizer.decode([token]))


async def respond_json(
    rt: Runtime, ps: list[Prepared], request: Request, body: Body
) -> JSONResponse:
    task = asyncio.create_task(_collect_all(rt, ps))
    while not task.done():
        await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if not task.done() and await request.is_disconnected():
            task.cancel()  # cancels the generation; the client is gone
            return JSONResponse({}, status_code=499)
    choices = task.result()
    headers = upfront_headers(ps[0]) | final_headers(choices[0].final)
    headers |= server_timing([choice.final for choice in choices])
    content = body(choices, rt.engine.lm.model_id, token_text(rt))
    return JSONResponse(content, headers=headers)


async def respond_stream(rt: Runtime, ps: list[Prepared], fmt: StreamFormat) -> StreamingResponse:
    """Errors before the first token become HTTP errors; later ones an error event."""
    items = execute(rt, ps[0])
    try:
        first = await anext(items)
    except ApiError as error:
        record(rt, ps[0], None, error)
        raise
    return StreamingResponse(
        _events(rt, ps, fmt, _prepend(first, items)),
        media_type="text/event-stream",
        headers=upfront_headers(ps[0]) | {"Cache-Control": "no-cache"},
    )


async def _collect_all(rt: Runtime, ps: list[Prepared]) -> list[Choice]:
    choices = []
    for i, p in enumerate(ps):
        try:
            choices.append(await _collect(rt, p))
        except asyncio.CancelledError:
            for waiting in ps[i:]:
                record(rt, waiting, None, ApiError(499, "client disconnected"))
            raise
        except ApiError as error:  # recorded for this choice; the rest never run
            for never_run in ps[i + 1 :]:
                record(rt, never_run, None, ApiError(error.status, error.message))
            raise
    return choices


async def _collect(rt: Runtime, p: Prepared) -> Choice:
    parts: list[str] = []
    try:
        async for item in execute(rt, p):
            if isinstance(item, Final):
                record(rt, p, item)
                return Choice(p, item, "".join(parts))
            parts.append(item)
    except ApiError as error:
        record(rt, p, None, error)
        raise
    raise ApiError(500, "generation ended without statistics")


async def _events(
    rt: Runtime,
    ps: list[Prepared],
    fmt: StreamFormat,
    first: AsyncGenerator[str | Final, None],
) -> AsyncIterator[bytes]:
    choices: list[Choice] = []
    for index, p in enumerate(ps):
        items = first if index == 0 else execute(rt, p)
        yield fmt.start(index, p)
        final: Final | None = None
        parts: list[str] = []
        try:
            async for item in items:
                if isinstance(item, Final):
                    final = item
                    choices.append(Choice(p, item, "".join(parts)))
                    yield fmt.finish(index, choices[-1])
                else:
                    parts.append(item)
                    yield fmt.delta(index, item)
            record(rt, p, final)
        except ApiError as error:
            record(rt, p, final, error)
            for never_run in ps[index + 1 :]:
                record(rt, never_run, None, ApiError(error.status, error.message))
            yield fmt.error(error)
            return
        except asyncio.CancelledError:
            for waiting in ps[index:]:
                record(rt, waiting, None, ApiError(499, "client disconnected"))
            raise
        finally:
            await items.aclose()
    yield fmt.end(choices)


async def _prepend(
    first: str | Final, items: AsyncGenerator[str | Final, None]
) -> AsyncGenerator[str | Final, None]:
    try:
        yield first
        async for item in items:
            yield item
    finally:
        await items.aclose()
