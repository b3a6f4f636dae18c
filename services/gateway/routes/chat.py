"""POST /v1/chat/completions and /v1/completions (OpenAI), POST /v1/messages and
/v1/messages/count_tokens (Anthropic)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.gateway.deps import PrincipalDep, RuntimeDep
from services.gateway.errors import ApiError
from services.gateway.formats import (
    AnthropicStream,
    CompletionStream,
    OpenAIStream,
    StreamFormat,
    anthropic_body,
    completion_body,
    openai_body,
)
from services.gateway.inputs import (
    ChatInput,
    anthropic_messages,
    from_anthropic,
    from_completion,
    from_openai,
)
from services.gateway.intake import Prepared, choices, prepare
from services.gateway.logprobs import TokenText
from services.gateway.respond import Body, respond_json, respond_stream, token_text
from services.gateway.runtime import Runtime
from services.gateway.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    CountTokensRequest,
    MessagesRequest,
)
from services.gateway.tracing import TraceParent

router = APIRouter()
T = TypeVar("T")
Reply = JSONResponse | StreamingResponse
Stream = Callable[[Prepared, str, TokenText], StreamFormat]


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, rt: RuntimeDep, _: PrincipalDep, request: Request
) -> Reply:
    chat = _convert(lambda: [from_openai(body)])
    return await _reply(rt, request, chat, OpenAIStream, openai_body)


@router.post("/v1/completions", response_model=None)
async def completions(
    body: CompletionRequest, rt: RuntimeDep, _: PrincipalDep, request: Request
) -> Reply:
    """Legacy completions: the prompt as is (no chat template); with `echo` and `logprobs`,
    the prompt's own token log-probabilities too (log-likelihood scoring)."""
    return await _reply(rt, request, from_completion(body), CompletionStream, completion_body)


@router.post("/v1/messages", response_model=None)
async def messages(
    body: MessagesRequest, rt: RuntimeDep, _: PrincipalDep, request: Request
) -> Reply:
    chat = _convert(lambda: [from_anthropic(body)])
    return await _reply(rt, request, chat, AnthropicStream, anthropic_body)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, rt: RuntimeDep, _: PrincipalDep) -> dict[str, int]:
    """Tokens the prompt takes with the served model's chat template (what `usage.
    input_tokens` reports for the same messages, before hygiene rewrites any text)."""
    texts = _convert(lambda: anthropic_messages(body))
    return {"input_tokens": len(rt.engine.encode_messages(texts))}


async def _reply(
    rt: Runtime,
    request: Request,
    inputs: list[ChatInput],
    stream_format: Stream,
    body: Body,
) -> Reply:
    caller = TraceParent.parse(request.headers)
    prepared = [q for chat in inputs for q in choices(rt, prepare(rt, chat, caller))]
    if inputs[0].stream:
        fmt = stream_format(prepared[0], rt.engine.lm.model_id, token_text(rt))
        return await respond_stream(rt, prepared, fmt)
    return await respond_json(rt, prepared, request, body)


def _convert(build: Callable[[], T]) -> T:
    try:
        return build()
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None
