"""Property-based requests from the gateway's own OpenAPI schema (schemathesis): whatever
the body, the answer is never a 5xx."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
            response = case.call(base_url=base_url, timeout=30)
            statuses[response.status_code] += 1
            if response.status_code >= 500:
                failures.append(
                    f"{case.method} {case.path}: {response.status_code} {response.text[:200]}"
                )

        check()
    assert not failures, failures
    assert statuses[200] > 0 and sum(v for k, v in statuses.items() if 400 <= k < 500) > 0, statuses
