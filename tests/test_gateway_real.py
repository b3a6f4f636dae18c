"""The gateway serving the real SmolLM2 through the official OpenAI SDK."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from sparse_engine.calibration.store import CalibrationStore
from sparse_engine.model.loader import LoadedModel
from sparse_engine.runtime.engine import Engine
from sparse_engine.runtime.prefix_cache import PrefixCache
from tests.gateway_fixtures import RecordingSink, running_gateway, settings_for

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("level", ["dense", "balanced"])
def test_openai_sdk_gets_tokyo_from_smollm(
    smollm: LoadedModel, calibrated_store: CalibrationStore, tmp_path: Path, level: str
) -> None:
    engine = Engine(smollm, calibrated_store.latest_plans(smollm.weights_sha256), PrefixCache())
    sink = RecordingSink()
    with (
        running_gateway(settings_for(tmp_path), engine, sink) as url,
        openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client,
    ):
        raw = client.chat.completions.with_raw_response.create(
            model="SmolLM2-135M-Instruct",
            # confident when dense (first token p = 0.73); France's was a coin flip (0.15/0.14)
            messages=[{"role": "user", "content": "What is the capital of Japan?"}],
            max_tokens=16,
            temperature=0,
            extra_body={"ir_sparse_level": level},
        )
    answer = raw.parse().choices[0].message.content or ""
    assert "Tokyo" in answer
    assert raw.headers["x-ir-level"] == level
    event = sink.by_trace(raw.headers["x-ir-trace-id"])
    assert event.model == "SmolLM2-135M-Instruct" and event.status == "ok"
    if level == "balanced":
        assert raw.headers["x-ir-calibration"].startswith("smollm2-135m-instruct-balanced")
        assert float(raw.headers["x-ir-sparsity"]) > 0.3
    assert raw.headers["x-ir-policy"] == "none"  # temperature 0 stays greedy
