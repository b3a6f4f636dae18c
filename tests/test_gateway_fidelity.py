"""The API a client expects, over real HTTP on loopback around the tiny engine: every field of
the official request schemas honoured or refused by name, log-probabilities, `n`, legacy
completions with echo, Anthropic's count_tokens; each response and stream event validated
strictly against the official SDKs' own types."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
import torch
from anthropic.types import Message, MessageCountTokensParams, RawMessageStreamEvent
from anthropic.types.message_create_params import MessageCreateParamsBase
from openai.types import Completion
from openai.types import completion_create_params as legacy_params
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.chat import completion_create_params as chat_params
from pydantic import BaseModel, TypeAdapter

from services.gateway.fields import ANTHROPIC_REFUSED, OPENAI_CHAT_REFUSED, Refusals
from services.gateway.fields import OPENAI_COMPLETIONS_REFUSED as LEGACY_REFUSED
from services.gateway.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    CountTokensRequest,
    MessagesRequest,
)
from sparse_engine.runtime.engine import Engine, GenerationRequest
from sparse_engine.sparsity.plan import Level
from tests.gateway_fixtures import RecordingSink, running_gateway, settings_for
from tests.tiny import tiny_engine

USER = [{"role": "user", "content": "Say hi"}]
SDK_USER: Any = USER  # the SDKs type their message dicts


@pytest.fixture(scope="module")
def sink() -> RecordingSink:
    return RecordingSink()


@pytest.fixture(scope="module")
def engine() -> Engine:
    return tiny_engine()


@pytest.fixture(scope="module")
def url(
    tmp_path_factory: pytest.TempPathFactory, sink: RecordingSink, engine: Engine
) -> Iterator[str]:
    with running_gateway(settings_for(tmp_path_factory.mktemp("home")), engine, sink) as base:
        yield base


@pytest.fixture
def oai(url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def test_every_official_request_field_is_honoured_or_refused() -> None:
    """The SDKs' own request types list the fields; a field added upstream fails this test
    until the gateway decides what to do with it."""
    cases: list[tuple[Any, type[BaseModel], Refusals]] = [
        (chat_params.CompletionCreateParamsBase, ChatCompletionRequest, OPENAI_CHAT_REFUSED),
        (legacy_params.CompletionCreateParamsBase, CompletionRequest, LEGACY_REFUSED),
        (MessageCreateParamsBase, MessagesRequest, ANTHROPIC_REFUSED),
        (MessageCountTokensParams, CountTokensRequest, ANTHROPIC_REFUSED),
    ]
    for params, model, refused in cases:
        official = set(params.__annotations__)
        unplaced = official - set(model.model_fields) - set(refused)
        assert not unplaced, (model.__name__, unplaced)
    # Fields older Anthropic SDKs and raw clients still send are honoured.
    assert {"temperature", "top_p", "top_k", "stream"} <= set(MessagesRequest.model_fields)


def test_logprobs_and_n_choices_are_honoured(
    url: str, oai: openai.OpenAI, sink: RecordingSink
) -> None:
    raw = httpx.post(
        f"{url}/v1/chat/completions",
        json={
            "messages": USER,
            "max_tokens": 5,
            "temperature": 0,
            "n": 2,
            "logprobs": True,
            "top_logprobs": 3,
            "ir_sparse_level": "balanced",
        },
        timeout=30,
    )
    assert raw.status_code == 200, raw.text
    body = ChatCompletion.model_validate(raw.json(), strict=True)
    assert [c.index for c in body.choices] == [0, 1]
    assert body.choices[0].message.content == body.choices[1].message.content  # greedy
    for choice in body.choices:
        assert choice.logprobs is not None and choice.logprobs.content
        for entry in choice.logprobs.content:
            tops = entry.top_logprobs
            assert len(tops) == 3 and tops[0].logprob >= tops[1].logprob >= tops[2].logprob
            assert entry.logprob == pytest.approx(tops[0].logprob, abs=1e-6)  # greedy
            assert entry.token == tops[0].token and entry.bytes == list(entry.token.encode())
    assert body.usage is not None
    assert body.usage.completion_tokens == sum(
        len(c.logprobs.content or []) for c in body.choices if c.logprobs
    )
    trace = raw.headers["x-ir-trace-id"]
    assert {sink.by_trace(t).status for t in (trace, f"{trace}-1")} == {"ok"}


def test_the_end_user_reaches_telemetry_only_hashed(
    oai: openai.OpenAI, sink: RecordingSink
) -> None:
    raw = oai.chat.completions.with_raw_response.create(
        model="tiny-llama", messages=SDK_USER, max_tokens=2, user="alice@example.com"
    )
    event = sink.by_trace(raw.headers["x-ir-trace-id"])
    assert event.end_user is not None and len(event.end_user) == 16
    assert "alice" not in event.model_dump_json()


def test_temperature_zero_is_greedy_at_a_sparse_level(oai: openai.OpenAI, engine: Engine) -> None:
    answer = oai.chat.completions.with_raw_response.create(
        model="tiny-llama",
        messages=SDK_USER,
        max_tokens=8,
        temperature=0,
        extra_body={"ir_sparse_level": "aggressive"},
    )
    direct = engine.generate(
        GenerationRequest(messages=USER, max_new_tokens=8, temperature=0.0), Level.AGGRESSIVE
    )
    text = "".join(direct)
    assert answer.headers["x-ir-policy"] == "none"
    assert answer.parse().choices[0].message.content == text


def test_penalties_and_logit_bias_shape_the_sampling(url: str, engine: Engine) -> None:
    forced = engine.encode_text("z")[0]

    def ask(**fields: Any) -> str:
        body = {"messages": USER, "max_tokens": 6, "temperature": 0, **fields}
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 200, response.text
        return str(response.json()["choices"][0]["message"]["content"])

    assert ask(logit_bias={str(forced): 100}) == "z" * 6
    # Penalties larger than the bias let the forced token win once only.
    penalised = ask(logit_bias={str(forced): 3}, frequency_penalty=2.0, presence_penalty=2.0)
    assert penalised.startswith("z") and penalised != "z" * 6
    bad = httpx.post(
        f"{url}/v1/chat/completions",
        json={"messages": USER, "logit_bias": {"999999": 1}},
        timeout=30,
    )
    assert bad.status_code == 400 and "999999" in bad.json()["error"]["message"]


def test_streamed_choices_validate_and_carry_logprobs(oai: openai.OpenAI) -> None:
    stream = oai.chat.completions.with_raw_response.create(
        model="tiny-llama",
        messages=SDK_USER,
        max_tokens=4,
        n=2,
        stream=True,
        logprobs=True,
        stream_options={"include_usage": True},
    )
    chunks = [
        ChatCompletionChunk.model_validate(json.loads(line[5:]), strict=True)
        for line in stream.http_response.iter_lines()
        if line.startswith("data:") and line != "data: [DONE]"
    ]
    finished = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.index for c in finished] == [0, 1]
    assert all(c.logprobs and c.logprobs.content for c in finished)
    assert chunks[-1].usage is not None and chunks[-1].choices == []


def test_legacy_completion_echoes_prompt_logprobs(
    oai: openai.OpenAI, engine: Engine, url: str
) -> None:
    prompt = "The cat sat"
    raw = oai.completions.with_raw_response.create(
        model="tiny-llama", prompt=prompt, max_tokens=2, temperature=0, logprobs=2, echo=True
    )
    body = Completion.model_validate(_first_echoed_token_dropped(json.loads(raw.text)), strict=True)
    choice = body.choices[0]
    assert choice.text.startswith(prompt) and choice.logprobs is not None
    ids = [*engine.lm.bos_prefix, *engine.encode_text(prompt)]
    logprobs = choice.logprobs.token_logprobs or []
    assert body.usage is not None
    sampled = body.usage.completion_tokens + (choice.finish_reason == "stop")  # with the end
    assert len(logprobs) + 1 == len(ids) + sampled
    # The prompt's log-likelihood, straight from the model at the dense level (default here
    # is balanced: ask for dense to compare with a plain forward pass).
    dense = httpx.post(
        f"{url}/v1/completions",
        json={
            "prompt": [ids],
            "max_tokens": 1,
            "logprobs": 1,
            "echo": True,
            "temperature": 0,
            "ir_sparse_level": "dense",
        },
        timeout=30,
    ).json()["choices"][0]["logprobs"]
    with torch.inference_mode():
        expected = engine.lm.model(input_ids=torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
    direct = expected.gather(-1, torch.tensor(ids[1:]).reshape(-1, 1)).reshape(-1).tolist()
    assert dense["token_logprobs"][1 : len(ids)] == pytest.approx(direct, abs=1e-4)
    assert dense["text_offset"][0] == 0 and dense["top_logprobs"][0] is None
    assert len(dense["tokens"]) == len(ids) + 1  # the one token sampled, even the end one


def _first_echoed_token_dropped(body: dict[str, Any]) -> dict[str, Any]:
    """The first echoed token has no log-probability: null there, as OpenAI's API sent it and
    lm-evaluation-harness expects, though the SDK's type has no room for it. Checked, then
    dropped so that the rest validates strictly."""
    for choice in body["choices"]:
        logprobs = choice["logprobs"]
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            logprobs[name] = logprobs[name][1:]
    return body


def test_legacy_completion_takes_lists_of_prompts_and_streams(url: str) -> None:
    response = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": ["One", "Two"], "n": 2, "max_tokens": 2, "seed": 3},
        timeout=30,
    )
    body = Completion.model_validate(response.json(), strict=True)
    assert [c.index for c in body.choices] == [0, 1, 2, 3]
    with httpx.stream(
        "POST",
        f"{url}/v1/completions",
        json={"prompt": "Go", "max_tokens": 3, "stream": True, "echo": True},
        timeout=30,
    ) as stream:
        events = [line[5:].strip() for line in stream.iter_lines() if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    parsed = [_streamed_legacy_chunk(json.loads(e)) for e in events[:-1]]
    chunks, reasons = [c for c, _ in parsed], [r for _, r in parsed]
    assert chunks[0].choices[0].text == "Go"
    assert reasons[:-1] == [None] * (len(reasons) - 1) and reasons[-1] in {"stop", "length"}


def _streamed_legacy_chunk(chunk: dict[str, Any]) -> tuple[Completion, str | None]:
    """A streamed legacy chunk and its finish reason: null until the last chunk, as OpenAI's
    API sends it, though the SDK's type has no room for it (its stream reader does not
    validate). Read, then filled so that the rest validates strictly."""
    reason = chunk["choices"][0]["finish_reason"]
    for choice in chunk["choices"]:
        choice["finish_reason"] = choice["finish_reason"] or "stop"
    return Completion.model_validate(chunk, strict=True), reason


def test_anthropic_responses_and_events_validate_strictly(url: str, engine: Engine) -> None:
    body = {
        "model": "tiny-llama",
        "max_tokens": 4,
        "messages": USER,
        "top_k": 5,
        "system": [{"type": "text", "text": "Be brief."}],
        "metadata": {"user_id": "u-1"},
    }
    response = httpx.post(f"{url}/v1/messages", json=body, timeout=30)
    Message.model_validate(response.json(), strict=True)
    with httpx.stream("POST", f"{url}/v1/messages", json={**body, "stream": True}) as stream:
        events = [json.loads(line[5:]) for line in stream.iter_lines() if line.startswith("data:")]
    adapter: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
    assert [adapter.validate_python(e, strict=True).type for e in events][-1] == "message_stop"
    with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0) as claude:
        counted = claude.messages.count_tokens(model="tiny-llama", messages=SDK_USER)
    assert counted.input_tokens == len(engine.encode_messages(USER))


REFUSED = [
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("/v1/chat/completions", {"temprature": 0.5}, "temprature: unknown field"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"n": 9}, "n"),
    ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "image_url parts",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "'tool'"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": [[]]}, "empty"),
    (
        "/v1/messages",
        {"max_tokens": 4, "thinking": {"type": "enabled", "budget_tokens": 9}},
        "thinking",
    ),
    ("/v1/messages", {"max_tokens": 4, "tools": [{"name": "f"}]}, "tools"),
    (
        "/v1/messages",
        {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
        "image parts",
    ),
    ("/v1/messages/count_tokens", {"max_tokens": 4}, "max_tokens: unknown field"),
]


@pytest.mark.parametrize(("path", "fields", "needle"), REFUSED)
def test_unsupported_fields_are_refused_by_name(
    url: str, path: str, fields: dict[str, Any], needle: str
) -> None:
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": USER}
    response = httpx.post(f"{url}{path}", json=body | fields, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()
    message = error["error"]["message"]
    assert needle in message, message
    if path.startswith("/v1/messages"):
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/completions"])
def test_a_lone_surrogate_is_a_400(url: str, path: str, sink: RecordingSink) -> None:
    body = b'{"max_tokens": 4, "messages": [{"role": "user", "content": "\\ud800"}]}'
    if path == "/v1/completions":
        body = b'{"prompt": "x\\udfff"}'
    before = len(sink.events)
    response = httpx.post(
        f"{url}{path}", content=body, headers={"content-type": "application/json"}, timeout=30
    )
    assert response.status_code == 400 and "surrogate" in response.text
    assert len(sink.events) == before + 1 and sink.events[-1].status == "error"


def test_a_failed_choice_leaves_an_event_for_every_choice(url: str, sink: RecordingSink) -> None:
    before = len(sink.events)
    too_long = {"messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 300, "n": 3}
    response = httpx.post(f"{url}/v1/chat/completions", json=too_long, timeout=30)
    assert response.status_code == 400 and "context" in response.json()["error"]["message"]
    events = sink.events[before:]
    assert [e.status for e in events] == ["error"] * 3
    assert len({e.trace_id for e in events}) == 3
