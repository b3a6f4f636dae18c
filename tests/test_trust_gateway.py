"""Trust actions through a real gateway on loopback (tiny engine, SQLite knowledge base): a
low-trust answer is regenerated once with knowledge-base passages, or simplified, or only
flagged, per route; the action shows in X-IR-Trust, the telemetry and the metrics. In proxy
mode a stand-in upstream (the real LLM API cannot run here) receives the augmented prompt."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from services.config import GatewaySettings, Settings, TelemetrySettings, TrustSettings
from services.gateway.fallback import SIMPLIFY
from services.shared.serving import serve
from services.storage.db import make_engine, session_factory, upgrade
from services.storage.kb import Passage, ingest
from sparse_engine.runtime.engine import Engine, GenerationRequest
from sparse_engine.runtime.sequence import Sequence
from sparse_engine.sparsity.plan import SparsityPlan
from sparse_engine.trust.features import RequestSignals
from sparse_engine.trust.model import TrustStore, fit
from tests.gateway_fixtures import RecordingSink, running_gateway
from tests.test_gateway_proxy import fake_upstream
from tests.tiny import tiny_engine

FACT = "The lighthouse keeper's secret word is marmalade."
QUESTION = "What is the lighthouse keeper's secret word?"


class RecordingEngine(Engine):
    """The tiny engine, keeping the messages of every generation it starts."""

    def __init__(self, inner: Engine) -> None:
        super().__init__(inner.lm, inner.plans, inner.prefix_cache)
        self.prompts: list[str] = []

    def start(
        self, request: GenerationRequest, plan: SparsityPlan, cancelled: threading.Event
    ) -> Sequence:
        self.prompts.append("\n".join(m["content"] for m in request.messages or []))
        return super().start(request, plan, cancelled)


def distrustful_model(home: Path, model_id: str, bias: float = -50.0, mode: str = "serve") -> None:
    """A stored trust model that scores every answer near 0, so every answer is low trust (or
    near sigmoid(`bias`)), of the given mode."""
    rng = random.Random(0)
    sigs = [RequestSignals(mean_logprob=rng.gauss(0, 1)) for _ in range(40)]
    model = fit(sigs, [s.mean_logprob > 0 for s in sigs], model_id=model_id, level="balanced",
                fit_data={"data": "test"}, l2=0.01, mode=mode)  # fmt: skip
    model.weights = [0.0] * len(model.weights)
    model.bias = bias
    TrustStore(home / "trust").save(model)


def settings_for(home: Path, **trust: Any) -> Settings:
    return Settings(
        home=home,
        gateway=GatewaySettings(**trust.pop("gateway", {})),
        telemetry=TelemetrySettings(enabled=False),
        trust=TrustSettings(**trust),
    )


def with_knowledge(settings: Settings, passages: list[Passage]) -> None:
    upgrade(settings.database_url)
    engine = make_engine(settings.database_url)
    with session_factory(engine)() as session:
        ingest(session, passages)
        session.commit()
    engine.dispose()


def ask(url: str, question: str = QUESTION, stream: bool = False) -> httpx.Response:
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 6,
        "ir_sparse_level": "balanced",
        "stream": stream,
    }
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def ask_anthropic(url: str) -> httpx.Response:
    body = {
        "model": "tiny-llama",
        "max_tokens": 6,
        "messages": [{"role": "user", "content": QUESTION}],
    }
    return httpx.post(f"{url}/v1/messages", json=body, timeout=60)


@pytest.fixture
def engine(tmp_path: Path) -> RecordingEngine:
    eng = RecordingEngine(tiny_engine(cache=False))
    distrustful_model(tmp_path, eng.lm.model_id)
    return eng


def test_low_trust_answer_is_regenerated_with_retrieved_passages(
    tmp_path: Path, engine: RecordingEngine
) -> None:
    settings = settings_for(tmp_path, actions={"/v1/chat/completions": "retrieve"})
    with_knowledge(
        settings, [Passage("notes", "Lighthouse", FACT), Passage("notes", "", "Jupiter is big.")]
    )
    sink = RecordingSink()
    with running_gateway(settings, engine, sink) as url:
        response = ask(url)
        metrics = httpx.get(f"{url}/metrics").text
    assert response.status_code == 200, response.text
    trust = response.headers["x-ir-trust"]
    assert "action=retrieve" in trust and "low-score" in trust and "passages=1" in trust
    assert len(engine.prompts) == 2 and FACT not in engine.prompts[0]
    assert FACT in engine.prompts[1] and engine.prompts[1].endswith(QUESTION)
    assert "Jupiter" not in engine.prompts[1]  # matched no term of the question
    event = sink.by_trace(response.headers["x-ir-trace-id"])
    assert event.trust_action == "retrieve" and "low-score" in event.trust_reasons
    assert event.trust_first_score is not None and event.trust_first_score < 0.01
    assert event.mean_token_logprob is not None and event.mean_token_logprob <= 0
    body = response.json()
    assert body["ir_stats"]["trust_action"] == "retrieve"
    assert (
        'sparseguard_gateway_trust_actions_total{action="retrieve",'
        'route="/v1/chat/completions"} 1.0' in metrics
    )
    assert 'sparseguard_gateway_trust_reasons_total{reason="low-score"} 1.0' in metrics


def test_nothing_retrieved_means_simplify_and_other_routes_only_flag(
    tmp_path: Path, engine: RecordingEngine
) -> None:
    settings = settings_for(tmp_path, actions={"/v1/chat/completions": "retrieve"})
    with_knowledge(settings, [Passage("notes", "", "Jupiter is the largest planet.")])
    sink = RecordingSink()
    with running_gateway(settings, engine, sink) as url:
        simple = ask(url)
        streamed = ask(url, stream=True)
        anthropic = httpx.post(
            f"{url}/v1/messages",
            json={
                "model": "tiny-llama",
                "max_tokens": 6,
                "messages": [{"role": "user", "content": "Hi"}],
            },
            timeout=60,
        )
    assert "action=simplify" in simple.headers["x-ir-trust"]
    assert engine.prompts[1].endswith(f"{QUESTION}\n\n{SIMPLIFY}")
    assert len(engine.prompts) == 4  # simplified twice over, streamed and anthropic once each
    final = [json.loads(line[6:]) for line in streamed.text.splitlines() if "ir_stats" in line]
    assert final[0]["ir_stats"]["trust_action"] == "flag"
    assert "action=flag" in anthropic.headers["x-ir-trust"]
    actions = [str(e.trust_action) for e in sink.events]
    assert sorted(actions) == ["flag", "flag", "simplify"]


def test_a_route_judged_by_closed_mode_models_retrieves_and_the_retried_answer_is_judged_as_served(
    tmp_path: Path,
) -> None:
    """The served (passage) model trusts every answer, the closed-book model none: the chat
    route, judged closed-book, retrieves; its regenerated answer, which carries passages, is
    scored by the served model; the Anthropic route is judged by the served model only."""
    engine = RecordingEngine(tiny_engine(cache=False))
    distrustful_model(tmp_path, engine.lm.model_id, bias=50.0)
    distrustful_model(tmp_path, engine.lm.model_id, bias=-50.0, mode="closed")
    settings = settings_for(
        tmp_path, default_action="retrieve", route_modes={"/v1/chat/completions": "closed"}
    )
    with_knowledge(settings, [Passage("notes", "Lighthouse", FACT)])
    with running_gateway(settings, engine, RecordingSink()) as url:
        chat = ask(url)
        anthropic = ask_anthropic(url)
        status = httpx.get(f"{url}/admin/status").json()
    assert chat.status_code == 200 and anthropic.status_code == 200, anthropic.text
    trust = chat.headers["x-ir-trust"]
    assert trust.startswith("1.000; action=retrieve;") and "low-score" in trust
    assert "first=0.000" in trust
    assert len(engine.prompts) == 3 and FACT in engine.prompts[1] and FACT not in engine.prompts[2]
    other = anthropic.headers["x-ir-trust"]
    assert other.startswith("1.000;") and "low-score" not in other and "first=" not in other
    assert status["trust_models"]["/v1/chat/completions balanced"].startswith("trust-closed-")


def test_proxy_mode_re_asks_the_upstream_with_the_passages(tmp_path: Path) -> None:
    seen: list[dict[str, object]] = []
    engine = tiny_engine(cache=False)
    distrustful_model(tmp_path, engine.lm.model_id)
    with serve(fake_upstream(seen)) as upstream:
        gateway = {
            "mode": "proxy",
            "upstream_url": f"{upstream}/v1",
            "upstream_api_key": SecretStr("sk-test"),
        }
        settings = settings_for(tmp_path, gateway=gateway, default_action="retrieve")
        with_knowledge(settings, [Passage("notes", "Lighthouse", FACT)])
        with running_gateway(settings, engine, RecordingSink()) as url:
            response = ask(url)
    assert response.status_code == 200, response.text
    assert "action=retrieve" in response.headers["x-ir-trust"]
    asked = [str(call["messages"]) for call in seen]
    assert len(asked) == 2 and FACT not in asked[0] and FACT in asked[1]


def test_a_route_threshold_replaces_the_flag_threshold_for_that_route_only(
    tmp_path: Path, engine: RecordingEngine
) -> None:
    """Every answer scores near 0; a chat route that acts only below 0 never finds it low,
    while the Anthropic route, without a threshold of its own, still does."""
    settings = settings_for(tmp_path, act_below={"/v1/chat/completions": 0.0})
    with running_gateway(settings, engine, RecordingSink()) as url:
        chat = ask(url)
        anthropic = ask_anthropic(url)
    assert chat.status_code == 200 and anthropic.status_code == 200, anthropic.text
    assert "low-score" not in chat.headers["x-ir-trust"]
    assert "low-score" in anthropic.headers["x-ir-trust"]
