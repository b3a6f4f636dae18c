"""The gateway over real HTTP on loopback, driven by the official `openai` and `anthropic`
SDKs and by raw requests, around the tiny random-init engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.gateway_fixtures import RecordingSink, running_gateway, settings_for
from tests.tiny import tiny_engine

LONG_SYSTEM = "You are a meticulous assistant for a hardware store. " * 5  # > 200 chars


@pytest.fixture(scope="module")
def sink() -> RecordingSink:
    return RecordingSink()


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory, sink: RecordingSink) -> Iterator[str]:
    settings = settings_for(
        tmp_path_factory.mktemp("home"), max_tokens_limit=512, max_body_bytes=20_000
    )
    with running_gateway(settings, tiny_engine(), sink) as base:
        yield base


@pytest.fixture
def oai(url: str) -> Iterator[openai.OpenAI]:
    """An OpenAI SDK client of the gateway, closed (with its connections) at the end."""
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def test_openai_sdk_completion_with_headers_and_telemetry(
    oai: openai.OpenAI, sink: RecordingSink
) -> None:
    raw = oai.chat.completions.with_raw_response.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "Say hi"}],
        max_tokens=8,
        extra_body={"ir_sparse_level": "balanced"},
    )
    completion = raw.parse()
    assert isinstance(completion.choices[0].message.content, str)
    assert completion.usage is not None and 1 <= completion.usage.completion_tokens <= 8
    headers = raw.headers
    assert headers["x-ir-level"] == "balanced"
    assert headers["x-ir-calibration"] == "tiny-balanced"
    assert 0.3 < float(headers["x-ir-sparsity"]) < 0.7
    assert float(headers["x-first-token-latency"]) > 0
    timing = dict(part.strip().split(";dur=") for part in headers["server-timing"].split(","))
    assert timing.keys() == {"queue", "engine"}
    assert float(timing["queue"]) >= 0
    assert float(timing["engine"]) >= float(headers["x-first-token-latency"]) * 0.999 > 0
    assert "temperature:" not in headers["x-ir-policy"]  # temperature defaults to 1.0
    event = sink.by_trace(headers["x-ir-trace-id"])
    assert event.status == "ok" and event.level == "balanced" and event.api == "openai"
    assert event.sparsity_ratio == pytest.approx(float(headers["x-ir-sparsity"]), abs=1e-4)
    assert len(event.silence_rate_per_layer) == 2


def test_openai_sdk_stream_ends_with_usage_and_stats(oai: openai.OpenAI) -> None:
    stream = oai.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "Count"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        temperature=0,
        extra_body={"ir_sparse": True, "ir_sparse_level": "aggressive"},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    *_, finish, last = chunks
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens >= 1
    assert finish.choices[0].finish_reason in {"stop", "length"}
    stats = (finish.model_extra or {})["ir_stats"]
    assert stats["level"] == "aggressive" and stats["sparsity_ratio"] > 0.5
    assert stats["policy"] == []  # temperature 0 stays greedy unless the raise is turned on
    assert len(text) > 0


@pytest.fixture
def claude(url: str) -> Iterator[anthropic.Anthropic]:
    """An Anthropic SDK client of the gateway, closed (with its connections) at the end."""
    with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0) as client:
        yield client


def test_anthropic_sdk_message_and_stream(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(
        model="tiny-llama",
        max_tokens=6,
        system=LONG_SYSTEM,
        messages=[{"role": "user", "content": "Hello"}],
        extra_body={"ir_sparse_level": "balanced"},
    )
    assert message.content[0].type == "text"
    assert message.usage.output_tokens >= 1
    assert "system_prompt>200" in " ".join((message.model_extra or {})["ir_stats"]["policy"])
    with claude.messages.stream(
        model="tiny-llama", max_tokens=6, messages=[{"role": "user", "content": "Hi"}]
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.content[0].type == "text" and final.content[0].text == streamed
    assert final.usage.output_tokens >= 1


def test_shared_system_prompt_hits_the_prefix_cache(oai: openai.OpenAI) -> None:
    hit_rates = []
    for question in ("first?", "second?"):
        raw = oai.chat.completions.with_raw_response.create(
            model="tiny-llama",
            max_tokens=2,
            messages=[
                {"role": "system", "content": "Cache me. " + LONG_SYSTEM},
                {"role": "user", "content": question},
            ],
            extra_body={"ir_sparse_level": "conservative"},
        )
        hit_rates.append(float(raw.headers["x-kv-cache-hit-rate"]))
    assert hit_rates[0] == 0.0 and hit_rates[1] > 0.8


def test_models_health_and_metrics(url: str, oai: openai.OpenAI) -> None:
    models = oai.models.list()
    assert [m.id for m in models.data] == ["tiny-llama"]
    assert httpx.get(f"{url}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{url}/readyz")
    assert ready.status_code == 200 and ready.json()["model_loaded"] is True
    metrics = httpx.get(f"{url}/metrics").text
    assert "sparseguard_gateway_requests_total" in metrics


BAD_OPENAI = [
    (b"{not json", 400, "not valid JSON"),
    (b'{"model": "", "messages": []}', 400, "messages"),
    (b'{"model": "", "messages": [{"role": "wizard", "content": "x"}]}', 400, "role"),
    (
        b'{"messages": [{"role": "user", "content": "x"}], "ir_sparse_level": "turbo"}',
        400,
        "ir_sparse_level",
    ),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', 400, "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}', 400, "at most 512"),
    (b'{"messages": [{"role": "user", "content": 5}]}', 400, "content"),
    (b'{"messages": [{"role": "user", "content": "   "}]}', 400, "non-system message"),
    (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, ""),
    (
        b'{"messages": [{"role": "user", "content": "' + b"x" * 400 + b'"}], "max_tokens": 300}',
        400,
        "context",
    ),
    (b'{"messages": [{"role": "user", "content": "' + b"x" * 30_000 + b'"}]}', 413, "larger than"),
]


@pytest.mark.parametrize(("body", "status", "needle"), BAD_OPENAI)
def test_bad_openai_input_gets_a_clear_error(
    url: str, body: bytes, status: int, needle: str
) -> None:
    response = httpx.post(
        f"{url}/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == status
    error = response.json()["error"]
    assert error["type"] in {"invalid_request_error", "request_too_large"}
    assert needle in error["message"]


def test_bad_anthropic_input_uses_anthropic_error_shape(url: str) -> None:
    response = httpx.post(
        f"{url}/v1/messages", json={"messages": [{"role": "user", "content": "x"}]}
    )
    assert response.status_code == 400
    body = response.json()
    assert body["type"] == "error" and "max_tokens" in body["error"]["message"]


def test_unknown_model_gets_each_apis_not_found_error(url: str, oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        oai.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    error = raised.value.response.json()["error"]
    assert error["code"] == "model_not_found" and error["type"] == "invalid_request_error"
    assert "'gpt-4o'" in error["message"] and "'tiny-llama'" in error["message"]
    body = {"model": "claude-x", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    reply = httpx.post(f"{url}/v1/messages", json=body)
    assert reply.status_code == 404
    assert reply.json()["error"]["type"] == "not_found_error"
    assert "'claude-x'" in reply.json()["error"]["message"]


def test_api_keys_are_checked(tmp_path: Path) -> None:
    from services.gateway.auth import hash_key

    keys = {"api_key_hashes": [hash_key("sk-good")], "admin_key_hashes": [hash_key("sk-admin")]}
    sink = RecordingSink()
    with running_gateway(settings_for(tmp_path, **keys), tiny_engine(), sink) as base:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        not_admin = httpx.get(f"{base}/admin/status", headers={"x-api-key": "sk-good"})
        admin = httpx.get(f"{base}/admin/status", headers={"x-api-key": "sk-admin"})
        missing = httpx.post(f"{base}/v1/chat/completions", json=body)
        wrong = httpx.post(
            f"{base}/v1/chat/completions", json=body, headers={"authorization": "Bearer sk-bad"}
        )
        good = httpx.post(f"{base}/v1/messages", json=body, headers={"x-api-key": "sk-good"})
    assert missing.status_code == 401 and "missing API key" in missing.json()["error"]["message"]
    assert wrong.status_code == 401 and "sk-bad" not in wrong.text
    assert good.status_code == 200
    assert not_admin.status_code == 403 and "admin" in not_admin.json()["error"]["message"]
    assert admin.status_code == 200 and admin.json()["levels"]["balanced"] == "tiny-balanced"
    # refused requests still produce telemetry: two 401s and one success
    assert sorted(e.error.type if e.error else "ok" for e in sink.events) == ["401", "401", "ok"]


def test_prompt_text_reaches_telemetry_only_when_kept(tmp_path: Path, sink: RecordingSink) -> None:
    assert all(event.prompt_text is None for event in sink.events)  # the default keeps none
    kept = settings_for(tmp_path)
    kept = kept.model_copy(
        update={
            "telemetry": kept.telemetry.model_copy(
                update={"keep_prompt_text": True, "prompt_sample_rate": 0.5}
            )
        }
    )
    recorded = RecordingSink()
    with running_gateway(kept, tiny_engine(), recorded) as base:
        for i in range(40):
            body = {"messages": [{"role": "user", "content": f"Tell me\x07 about {i}"}]}
            reply = httpx.post(f"{base}/v1/chat/completions", json={**body, "max_tokens": 1})
            assert reply.status_code == 200
    texts = [e.prompt_text for e in recorded.events if e.prompt_text is not None]
    assert 8 <= len(texts) <= 32  # about half, chosen by trace id
    assert all(t.startswith("Tell me about ") for t in texts)  # the cleaned text
