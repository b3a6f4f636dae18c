"""Request bodies of the three endpoints (OpenAI chat completions and legacy completions,
Anthropic messages), validated with pydantic: every field is honoured or refused by name
(`fields`). `inputs` turns them into the one internal form."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.gateway.fields import (
    ANTHROPIC_REFUSED,
    OPENAI_CHAT_REFUSED,
    OPENAI_COMPLETIONS_REFUSED,
    Refusals,
    no_lone_surrogates,
    refuse,
)

LevelName = Literal["dense", "conservative", "balanced", "aggressive", "auto"]
Api = Literal["openai", "anthropic"]
MAX_CHOICES = 8  # n: each choice is a whole generation on the one engine
MAX_PROMPTS = 32  # legacy completions: prompts in one request
MAX_TOP_LOGPROBS = 20


class Screened(BaseModel):
    """A body whose fields are screened before parsing: lone surrogates anywhere, then every
    field against the honoured set (the model's own fields) and the refusal table."""

    model_config = ConfigDict(extra="forbid")
    refused: ClassVar[Refusals] = {}

    @model_validator(mode="before")
    @classmethod
    def _screen(cls, data: Any) -> Any:
        no_lone_surrogates(data)
        refuse(data, set(cls.model_fields), cls.refused)
        return data


class SparseOptions(Screened):
    """The gateway's own extension fields (sent with `extra_body` from the SDKs)."""

    ir_sparse: bool | None = None
    ir_sparse_level: LevelName | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class OpenAISampling(SparseOptions):
    """The sampling fields both OpenAI endpoints share."""

    model: str = Field("", max_length=256)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = Field(None, max_length=256)

    @field_validator("stop")
    @classmethod
    def _at_most_four_stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (v or {}).items():
            if not token.isdigit():
                raise ValueError(f"keys are token ids (digits), got {token!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"bias for token {token} must be within -100 and 100")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> OpenAISampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream=true")
        return self


class OpenAIMessage(Screened):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, object]]
    refused: ClassVar[Refusals] = {
        "name": ("participant names are not supported; put the name in the content", ("",)),
        "tool_calls": ("tool calls are not supported", ([],)),
        "function_call": ("function calls are not supported", ()),
        "tool_call_id": ("tool messages are not supported", ()),
        "refusal": ("assistant refusals are not supported as input", ()),
        "audio": ("audio is not supported", ()),
    }

    @field_validator("role", mode="before")
    @classmethod
    def _no_tool_roles(cls, v: object) -> object:
        if v in ("tool", "function"):
            raise ValueError(f"'{v}' messages are not supported (no tool calling)")
        return v


class ChatCompletionRequest(OpenAISampling):
    messages: list[OpenAIMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    safety_identifier: str | None = Field(None, max_length=256)
    refused: ClassVar[Refusals] = OPENAI_CHAT_REFUSED

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: only allowed with logprobs=true")
        return self


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(OpenAISampling):
    prompt: Prompt
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    refused: ClassVar[Refusals] = OPENAI_COMPLETIONS_REFUSED

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v: Prompt) -> Prompt:
        if isinstance(v, list):
            if not v:
                raise ValueError("must not be empty")
            if isinstance(v[0], list | str) and len(v) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts in one request")
            if any(isinstance(p, list) and not p for p in v):
                raise ValueError("a token-id prompt must not be empty")
            ids = [t for p in v for t in (p if isinstance(p, list) else [p])]
            if any(isinstance(t, int) and t < 0 for t in ids):
                raise ValueError("token ids must not be negative")
        return v


class AnthropicMessage(Screened):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, object]]


class AnthropicMetadata(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_id: str | None = Field(None, max_length=256)


class AnthropicBase(Screened):
    model: str = Field("", max_length=256)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, object]] | None = None
    refused: ClassVar[Refusals] = ANTHROPIC_REFUSED


class MessagesRequest(AnthropicBase):
    max_tokens: int = Field(ge=1)
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)
    stop_sequences: list[str] | None = Field(None, max_length=8)
    stream: bool = False
    metadata: AnthropicMetadata | None = None
    ir_sparse: bool | None = None
    ir_sparse_level: LevelName | None = None


class CountTokensRequest(AnthropicBase):
    """POST /v1/messages/count_tokens: the body of a messages request without the sampling
    fields (the official endpoint takes none of them)."""
