"""Each endpoint's validated request in one internal form, `ChatInput`: plain-text messages
(system prompt first) or a raw prompt, and the sampling settings the caller asked for."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Literal

from services.gateway.schemas import (
    AnthropicBase,
    Api,
    ChatCompletionRequest,
    CompletionRequest,
    MessagesRequest,
    OpenAISampling,
)

Endpoint = Literal["chat", "completions", "messages"]


@dataclass(frozen=True, slots=True)
class ChatInput:
    """One request in one form. `prompt`/`prompt_ids` (legacy completions) are sent to the
    model as they are, without a chat template; `messages` then holds the prompt as one user
    message, for the policy, hygiene and the trust score."""

    api: Api
    model: str
    messages: list[dict[str, str]]
    max_tokens: int | None
    temperature: float | None
    top_p: float
    stop: tuple[str, ...]
    stream: bool
    ir_sparse: bool | None
    ir_sparse_level: str | None
    seed: int | None = None
    endpoint: Endpoint = "chat"
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    top_k: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    include_usage: bool = True  # OpenAI streams: the usage chunk only when asked for
    end_user: str | None = None  # a hash of the caller's end-user id (`user`, metadata)
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    echo: bool = False

    @property
    def system_text(self) -> str:
        return "\n".join(m["content"] for m in self.messages if m["role"] == "system")

    @property
    def user_text(self) -> str:
        return "\n".join(m["content"] for m in self.messages if m["role"] == "user")

    @property
    def raw(self) -> bool:
        """A legacy-completions prompt, sent as is."""
        return self.endpoint == "completions"


def text_of(content: str | list[dict[str, object]]) -> str:
    """The text of a message: a string, or the `text` parts of a content-block list; any
    other part is refused by its type."""
    if isinstance(content, str):
        return content
    parts = []
    for i, block in enumerate(content):
        kind = block.get("type")
        if kind != "text":
            raise ValueError(f"content[{i}]: {kind!s} parts are not supported (text only)")
        extra = sorted(set(block) - {"type", "text"})
        if extra:
            raise ValueError(f"content[{i}].{extra[0]}: not supported on text parts")
        if not isinstance(block.get("text"), str):
            raise ValueError(f"content[{i}].text: must be a string")
        parts.append(str(block["text"]))
    return "".join(parts)


def hashed_user(user: str | None) -> str | None:
    """End-user ids leave the gateway only as a short hash (enough to group by, not to read)."""
    return hashlib.sha256(user.encode()).hexdigest()[:16] if user else None


def _openai_sampling(body: OpenAISampling) -> dict[str, Any]:
    """The ChatInput fields both OpenAI endpoints fill alike."""
    options = body.stream_options
    return {
        "api": "openai",
        "model": body.model,
        "temperature": body.temperature,
        "top_p": body.top_p or 1.0,
        "stop": (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ()),
        "stream": body.stream,
        "ir_sparse": body.ir_sparse,
        "ir_sparse_level": body.ir_sparse_level,
        "seed": body.seed,
        "n": body.n,
        "presence_penalty": body.presence_penalty or 0.0,
        "frequency_penalty": body.frequency_penalty or 0.0,
        "logit_bias": {int(k): v for k, v in (body.logit_bias or {}).items()},
        "include_usage": bool(options and options.include_usage),
    }


def from_openai(body: ChatCompletionRequest) -> ChatInput:
    messages = []
    for i, m in enumerate(body.messages):
        role = "system" if m.role == "developer" else m.role
        messages.append({"role": role, "content": _text(m.content, f"messages[{i}].")})
    return ChatInput(
        messages=messages,
        max_tokens=body.max_completion_tokens or body.max_tokens,
        logprobs=bool(body.logprobs),
        top_logprobs=body.top_logprobs or 0,
        end_user=hashed_user(body.safety_identifier or body.user),
        **_openai_sampling(body),
    )


def from_completion(body: CompletionRequest) -> list[ChatInput]:
    """One input per prompt (a list of prompts is answered choice by choice, in order)."""
    prompts = body.prompt
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]  # type: ignore[assignment]
    inputs = []
    for prompt in prompts:
        text = prompt if isinstance(prompt, str) else None
        inputs.append(
            ChatInput(
                messages=[{"role": "user", "content": text or ""}],
                max_tokens=body.max_tokens,
                endpoint="completions",
                logprobs=body.logprobs is not None,
                top_logprobs=body.logprobs or 0,
                end_user=hashed_user(body.user),
                prompt=text,
                prompt_ids=None if text is not None else list(prompt),  # type: ignore[arg-type]
                echo=body.echo,
                **_openai_sampling(body),
            )
        )
    return inputs


def anthropic_messages(body: AnthropicBase) -> list[dict[str, str]]:
    messages = [
        {"role": m.role, "content": _text(m.content, f"messages[{i}].")}
        for i, m in enumerate(body.messages)
    ]
    if body.system:
        messages.insert(0, {"role": "system", "content": _text(body.system, "system.")})
    return messages


def from_anthropic(body: MessagesRequest) -> ChatInput:
    return ChatInput(
        api="anthropic",
        model=body.model,
        messages=anthropic_messages(body),
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p or 1.0,
        stop=tuple(body.stop_sequences or ()),
        stream=body.stream,
        ir_sparse=body.ir_sparse,
        ir_sparse_level=body.ir_sparse_level,
        endpoint="messages",
        top_k=body.top_k or 0,
        end_user=hashed_user(body.metadata.user_id if body.metadata else None),
    )


def _text(content: str | list[dict[str, object]], where: str) -> str:
    try:
        return text_of(content)
    except ValueError as exc:
        raise ValueError(f"{where}{exc}") from None
