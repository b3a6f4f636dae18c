"""Proxy mode against a stand-in upstream: a small OpenAI-compatible server on loopback (the
real upstream LLM API cannot run here). The gateway forwards, then probes the answer with its
own engine, teacher-forced."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import SecretStr

from services.shared.serving import free_port, serve
from tests.gateway_fixtures import RecordingSink, running_gateway, settings_for
from tests.tiny import tiny_engine

ANSWER = ["The capital ", "of France ", "is Paris."]


def fake_upstream(seen: list[dict[str, object]]) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions", response_model=None)
    async def complete(request: Request) -> JSONResponse | StreamingResponse:
        body = await request.json()
        seen.append({"auth": request.headers.get("authorization"), **body})
        if body["model"] == "fail":
            return JSONResponse({"error": {"message": "model overloaded"}}, status_code=500)
        if body["model"] == "slow":
            await asyncio.sleep(3)

        async def chunks() -> AsyncIterator[bytes]:
            for part in ANSWER:
                chunk = {"choices": [{"index": 0, "delta": {"content": part}}]}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def seen() -> list[dict[str, object]]:
    return []


@pytest.fixture(scope="module")
def upstream(seen: list[dict[str, object]]) -> Iterator[str]:
    with serve(fake_upstream(seen)) as url:
        yield url


@pytest.fixture(scope="module")
def sink() -> RecordingSink:
    return RecordingSink()


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, upstream: str, sink: RecordingSink
) -> Iterator[str]:
    settings = settings_for(
        tmp_path_factory.mktemp("home"),
        mode="proxy",
        upstream_url=f"{upstream}/v1",
        upstream_api_key=SecretStr("sk-upstream-secret"),
        upstream_timeout_s=1.0,
        raise_zero_temperature=True,  # a serve-mode policy: it must not reach the upstream
    )
    with running_gateway(settings, tiny_engine(), sink) as url:
        yield url


def ask(gateway: str, model: str, stream: bool = False) -> httpx.Response:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Capital of France?"}],
        "stream": stream,
    }
    return httpx.post(
        f"{gateway}/v1/chat/completions", json={**body, "ir_sparse_level": "balanced"}, timeout=30
    )


def test_proxy_returns_upstream_answer_with_probe_signals(
    gateway: str, seen: list[dict[str, object]], sink: RecordingSink
) -> None:
    response = ask(gateway, "ok")
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "".join(ANSWER)
    assert 0.3 < float(response.headers["x-ir-sparsity"]) < 0.7
    assert seen[-1]["auth"] == "Bearer sk-upstream-secret"
    event = sink.by_trace(response.headers["x-ir-trace-id"])
    assert event.mode == "proxy" and event.completion_tokens > 0
    assert event.gate_confidence is not None and 0 < event.gate_confidence < 1
    assert "sk-upstream-secret" not in event.model_dump_json()


def test_proxy_streams_through_openai_sdk(gateway: str) -> None:
    with openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0) as client:
        chunks = list(
            client.chat.completions.create(
                model="ok", messages=[{"role": "user", "content": "Q?"}], stream=True
            )
        )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(ANSWER)
    assert (chunks[-1].model_extra or {})["ir_stats"]["level"] == "balanced"


def test_the_callers_sampling_reaches_the_upstream_unchanged(
    gateway: str, seen: list[dict[str, object]]
) -> None:
    sampling = {
        "temperature": 0,
        "max_tokens": 3000,
        "seed": 7,
        "presence_penalty": 0.5,
        "logit_bias": {"42": -3.0},
        "stop": ["\n\n"],
    }
    body = {
        "model": "ok",
        "messages": [{"role": "user", "content": "Capital of France?"}],
        "user": "alice",
        "ir_sparse_level": "aggressive",  # caps max_tokens and raises temperature 0 in serve mode
        **sampling,
    }
    response = httpx.post(f"{gateway}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["x-ir-policy"] == "none"
    forwarded = seen[-1]
    assert {k: forwarded[k] for k in sampling} == sampling
    assert forwarded["user"] not in (None, "alice")  # the end-user id leaves only as a hash
    assert "top_p" not in forwarded and "n" not in forwarded  # left out stays out


@pytest.mark.parametrize(
    ("path", "fields", "needle"),
    [
        ("/v1/chat/completions", {"n": 2}, "n:"),
        ("/v1/chat/completions", {"logprobs": True}, "logprobs:"),
        ("/v1/completions", {"prompt": "x"}, "/v1/completions:"),
    ],
)
def test_what_proxy_mode_cannot_relay_is_refused(
    gateway: str, path: str, fields: dict[str, object], needle: str
) -> None:
    body = (
        fields
        if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": "Q"}]} | fields
    )
    response = httpx.post(f"{gateway}{path}", json={"model": "ok", **body}, timeout=30)
    assert response.status_code == 400 and needle in response.json()["error"]["message"]


def test_upstream_failure_is_502_and_timeout_504(gateway: str) -> None:
    failed = ask(gateway, "fail")
    assert failed.status_code == 502 and "HTTP 500" in failed.json()["error"]["message"]
    slow = ask(gateway, "slow")
    assert slow.status_code == 504 and "did not answer" in slow.json()["error"]["message"]


def test_unreachable_upstream_is_502(tmp_path: Path) -> None:
    settings = settings_for(
        tmp_path, mode="proxy", upstream_url=f"http://127.0.0.1:{free_port()}/v1"
    )
    with running_gateway(settings, tiny_engine(), RecordingSink()) as url:
        response = ask(url, "ok")
    assert response.status_code == 502 and "unreachable" in response.json()["error"]["message"]
