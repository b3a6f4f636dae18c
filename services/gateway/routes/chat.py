"""POST /v1/chat/completions (OpenAI) and POST /v1/messages (Anthropic)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.gateway.deps import PrincipalDep, RuntimeDep
from services.gateway.errors import ApiError
from services.gateway.formats import (
    AnthropicStream,
    OpenAIStream,
    StreamFormat,
    anthropic_body,
    openai_body,
)
from services.gateway.pipeline import Prepared, prepare
from services.gateway.respond import Body, respond_json, respond_stream
from services.gateway.runtime import Runtime
from services.gateway.schemas import (
    ChatCompletionRequest,
    ChatInput,
    MessagesRequest,
    from_anthropic,
    from_openai,
)

router = APIRouter()
Reply = JSONResponse | StreamingResponse


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, rt: RuntimeDep, _: PrincipalDep, request: Request
) -> Reply:
    return await _reply(rt, request, _convert(lambda: from_openai(body)), OpenAIStream, openai_body)


@router.post("/v1/messages", response_model=None)
async def messages(
    body: MessagesRequest, rt: RuntimeDep, _: PrincipalDep, request: Request
) -> Reply:
    chat = _convert(lambda: from_anthropic(body))
    return await _reply(rt, request, chat, AnthropicStream, anthropic_body)


async def _reply(
    rt: Runtime,
    request: Request,
    chat: ChatInput,
    stream_format: Callable[[Prepared, str], StreamFormat],
    body: Body,
) -> Reply:
    p = prepare(rt, chat)
    if chat.stream:
        return await respond_stream(rt, p, stream_format(p, rt.engine.lm.model_id))
    return await respond_json(rt, p, request, body)


def _convert(build: Callable[[], ChatInput]) -> ChatInput:
    try:
        return build()
    except ValueError as exc:
        raise ApiError(400, f"messages: {exc}") from None
