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
