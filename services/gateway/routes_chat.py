"""POST /v1/chat/completions (OpenAI) and POST /v1/messages (Anthropic)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.gateway.deps import PrincipalDep, RuntimeDep
from services.gateway.errors import ApiError
from services.gateway.formats import AnthropicStream, OpenAIStream, anthropic_body, openai_body
from services.gateway.pipeline import prepare
from services.gateway.respond import respond_json, respond_stream
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
    chat = _convert(lambda: from_openai(body))
    p = prepare(rt, chat)
    if chat.stream:
        return await respond_stream(rt, p, OpenAIStream(p, rt.engine.lm.model_id))
    return await respond_json(rt, p, request, openai_body)


@router.post("/v1/messages", response_model=None)
async def messages(
    body: MessagesRequest, rt: RuntimeDep, _: PrincipalDep, request: Request
) -> Reply:
    chat = _convert(lambda: from_anthropic(body))
    p = prepare(rt, chat)
    if chat.stream:
        return await respond_stream(rt, p, AnthropicStream(p, rt.engine.lm.model_id))
    return await respond_json(rt, p, request, anthropic_body)


def _convert(build: object) -> ChatInput:
    try:
        return build()  # type: ignore[operator, no-any-return]
    except ValueError as exc:
        raise ApiError(400, f"messages: {exc}") from None
