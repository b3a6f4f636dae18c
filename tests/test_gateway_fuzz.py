"""Property-based requests from the gateway's own OpenAPI schema (schemathesis): whatever
the body, the answer is never a 5xx."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.gateway_fixtures import RecordingSink, running_gateway, settings_for
from tests.tiny import tiny_engine


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cfg = settings_for(Path(tmp_path_factory.mktemp("home")), max_tokens_limit=8)
    with running_gateway(cfg, tiny_engine(), RecordingSink()) as url:
        yield url


def test_no_server_errors_from_schema_generated_requests(base_url: str) -> None:
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    statuses: Counter[int] = Counter()
    failures: list[str] = []

    for result in schema.get_all_operations():
        operation = result.ok()  # type: ignore[union-attr]

        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def check(case: schemathesis.Case[Any]) -> None:
            # Sent with httpx: schemathesis' requests transport breaks when urllib3-future
            # (pulled in by grafana-client through niquests) replaces urllib3.
            kwargs = case.as_transport_kwargs(base_url=base_url)
            headers = dict(kwargs.get("headers") or {})
            if "json" in kwargs:
                headers.setdefault("Content-Type", "application/json")
            response = httpx.request(
                kwargs["method"],
                kwargs["url"],
                headers=headers,
                params=kwargs.get("params"),
                cookies=kwargs.get("cookies"),
                content=_content(kwargs),
                timeout=30,
            )
            statuses[response.status_code] += 1
            if response.status_code >= 500:
                failures.append(
                    f"{case.method} {case.path}: {response.status_code} {response.text[:200]}"
                )

        check()
    assert not failures, failures
    assert statuses[200] > 0 and sum(v for k, v in statuses.items() if 400 <= k < 500) > 0, statuses


def _content(kwargs: dict[str, Any]) -> bytes | None:
    """The request body as bytes, whichever form the transport chose."""
    if "json" in kwargs:
        return json.dumps(kwargs["json"]).encode()
    data = kwargs.get("data")
    return data.encode() if isinstance(data, str) else data


HOSTILE = [
    b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
    b'{"messages": [{"role": "user", "content": "a\\u0000b"}], "max_tokens": 2}',
    b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1e400}',
    b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
    b'{"messages": [{"role": "user", "content": "x"}], "n": 99999999999999999999}',
    b'{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"-1": 5}}',
    b'{"messages": [{"role": "user", "content": "x"}], "stop": ["\\udfff"]}',
    b'{"messages": ' + b"[" * 500 + b"]" * 500 + b"}",
    b'{"prompt": [[1, 2], "mixed"], "max_tokens": 2}',
    b'{"prompt": [99999999999], "max_tokens": 2}',
    b'{"prompt": "x", "logprobs": 5, "echo": true, "max_tokens": 2}',
    b'{"\\ud800": 1, "messages": [{"role": "user", "content": "x"}]}',
    b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "\\udc00": 1}]}]}',
    b"[]",
    b'"just a string"',
]
POSTS = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens"]


@pytest.mark.parametrize("path", POSTS)
def test_hostile_bodies_get_a_4xx_in_the_apis_shape(base_url: str, path: str) -> None:
    """A set of hostile requests (lone surrogates, NUL bytes, overflowing and non-finite
    numbers, deep nesting, token ids outside the vocabulary) on every POST endpoint: each is
    answered (a 4xx in the endpoint's error shape, or a 200), never a 500 or a hang."""
    for body in HOSTILE:
        response = httpx.post(
            f"{base_url}{path}",
            content=body,
            headers={"content-type": "application/json"},
            timeout=30,
        )
        assert response.status_code < 500, (body[:80], response.text[:200])
        if response.status_code >= 400:
            error = response.json()
            shape = error["error"]["type"] if "error" in error else None
            assert shape, (body[:80], error)
            if path.startswith("/v1/messages"):
                assert error["type"] == "error", error
