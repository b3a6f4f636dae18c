"""Request bodies of both APIs (OpenAI chat completions, Anthropic messages), validated with
pydantic, and the one internal form both are turned into."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

LevelName = Literal["dense", "conservative", "balanced", "aggressive", "auto"]
Api = Literal["openai", "anthropic"]


class OpenAIMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, object]]


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field("", max_length=256)
    messages: list[OpenAIMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    stream: bool = False
    seed: int | None = None
    ir_sparse: bool | None = None
    ir_sparse_level: LevelName | None = None

    @field_validator("stop")
    @classmethod
    def _at_most_four_stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        return v


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["user", "assistant"]
    content: str | list[dict[str, object]]


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field("", max_length=256)
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, object]] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop_sequences: list[str] | None = Field(None, max_length=8)
    stream: bool = False
    ir_sparse: bool | None = None
    ir_sparse_level: LevelName | None = None


@dataclass(frozen=True, slots=True)
class ChatInput:
    """Either API's request in one form: plain-text messages, system prompt first."""

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

    @property
    def system_text(self) -> str:
        return "\n".join(m["content"] for m in self.messages if m["role"] == "system")

    @property
    def user_text(self) -> str:
        return "\n".join(m["content"] for m in self.messages if m["role"] == "user")


def text_of(content: str | list[dict[str, object]]) -> str:
    """The text of a message: a string, or the `text` parts of a content-block list."""
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise ValueError("only text content blocks are supported")
        parts.append(str(block["text"]))
    return "".join(parts)


def from_openai(body: ChatCompletionRequest) -> ChatInput:
    messages = [
        {"role": "system" if m.role == "developer" else m.role, "content": text_of(m.content)}
        for m in body.messages
    ]
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return ChatInput(
        api="openai",
        model=body.model,
        messages=messages,
        max_tokens=body.max_completion_tokens or body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p or 1.0,
        stop=stop,
        stream=body.stream,
        ir_sparse=body.ir_sparse,
        ir_sparse_level=body.ir_sparse_level,
        seed=body.seed,
    )


def from_anthropic(body: MessagesRequest) -> ChatInput:
    messages = [{"role": m.role, "content": text_of(m.content)} for m in body.messages]
    if body.system:
        messages.insert(0, {"role": "system", "content": text_of(body.system)})
    return ChatInput(
        api="anthropic",
        model=body.model,
        messages=messages,
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p or 1.0,
        stop=tuple(body.stop_sequences or ()),
        stream=body.stream,
        ir_sparse=body.ir_sparse,
        ir_sparse_level=body.ir_sparse_level,
    )
