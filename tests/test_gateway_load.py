"""Back-pressure and cancellation: a full engine queue answers 429 with Retry-After, and a
client that disconnects stops its generation."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from pathlib import Path

import httpx
import pytest

from services.gateway.engine_thread import EngineWorker
from sparse_engine.runtime import kernels
from tests.gateway_fixtures import GatedEngine, RecordingSink, running_gateway, settings_for
from tests.polling import wait_until
from tests.tiny import tiny_engine

BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def queue_depth(url: str) -> int:
    return int(httpx.get(f"{url}/admin/status").json()["queue_depth"])


def test_full_queue_answers_429_with_retry_after(tmp_path: Path) -> None:
    engine = GatedEngine(tiny_engine())
    gateway = running_gateway(settings_for(tmp_path, queue_size=1), engine, RecordingSink())
    with gateway as url, concurrent.futures.ThreadPoolExecutor(4) as pool:
        post = f"{url}/v1/chat/completions"
        # one request is held inside the engine, then a second waits in the queue
        held = [pool.submit(httpx.post, post, json=BODY, timeout=30)]
        wait_until(lambda: engine.entered == 1 and queue_depth(url) == 0)
        held.append(pool.submit(httpx.post, post, json=BODY, timeout=30))
        wait_until(lambda: queue_depth(url) == 1)
        refused = httpx.post(post, json=BODY, timeout=30)
        engine.gate.set()
        statuses = sorted(f.result().status_code for f in held)
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert statuses == [200, 200]


def test_client_disconnect_cancels_generation(tmp_path: Path) -> None:
    sink = RecordingSink()
    body = {
        "messages": [{"role": "user", "content": "go"}],
        "max_tokens": 400,
        "stream": True,
        "temperature": 0,
    }
    engine = GatedEngine(tiny_engine(), token_delay_s=0.02, open_gate=True)
    with running_gateway(settings_for(tmp_path, max_tokens_limit=400), engine, sink) as url:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            trace = response.headers["x-ir-trace-id"]
            lines = response.iter_lines()
            next(lines)
            next(lines)
        deadline = time.monotonic() + 10
        while not any(e.trace_id == trace for e in sink.events) and time.monotonic() < deadline:
            time.sleep(0.05)
        while not engine.finished and time.monotonic() < deadline:
            time.sleep(0.05)
    event = sink.by_trace(trace)
    assert event.status == "error" and event.error is not None
    assert "disconnected" in event.error.message
    stats = engine.finished[-1]
    assert stats.finish_reason == "cancelled"
    assert stats.completion_tokens < 400


def test_request_past_its_time_limit_answers_504(tmp_path: Path) -> None:
    engine = GatedEngine(tiny_engine(), token_delay_s=0.05, open_gate=True)
    settings = settings_for(tmp_path, request_timeout_s=0.5, max_tokens_limit=200)
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 200, "temperature": 0}
    with running_gateway(settings, engine, RecordingSink()) as url:
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 504
    assert "within 0.5 s" in response.json()["error"]["message"]


def test_calls_run_on_the_engine_thread_in_turn() -> None:
    """`call` runs on the one engine thread (where the gateway loads the model, so PyTorch's
    thread pool is that thread's), after the jobs queued before it; errors come back."""
    worker = EngineWorker(queue_size=4)
    try:
        first = worker.call(threading.get_ident).result(timeout=10)
        again = worker.call(threading.get_ident).result(timeout=10)
        assert first == again != threading.get_ident()
        failing = worker.call(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            failing.result(timeout=10)
    finally:
        worker.close()


def test_concurrent_requests_share_decode_steps(tmp_path: Path) -> None:
    """Requests in flight together join one batch: each one's telemetry and the batch-size
    histogram say so, and each answer is the one it gets alone (greedy)."""
    inner = tiny_engine()
    inner.enable_fast_path("float32", kernels.load(), max_len=512)
    engine = GatedEngine(inner)
    sink = RecordingSink()
    body = {"messages": [{"role": "user", "content": "go on"}], "max_tokens": 40, "temperature": 0}
    with (
        running_gateway(settings_for(tmp_path, max_tokens_limit=64), engine, sink) as url,
        concurrent.futures.ThreadPoolExecutor(3) as pool,
    ):
        post = f"{url}/v1/chat/completions"
        held = [pool.submit(httpx.post, post, json=body, timeout=60) for _ in range(3)]
        wait_until(lambda: engine.entered == 1 and queue_depth(url) == 2)
        engine.gate.set()
        answers = [f.result() for f in held]
        alone = httpx.post(post, json=body, timeout=60)
        metrics = httpx.get(f"{url}/metrics").text
    assert all(a.status_code == 200 for a in answers)
    texts = {a.json()["choices"][0]["message"]["content"] for a in answers}
    assert texts == {alone.json()["choices"][0]["message"]["content"]}
    batched = [sink.by_trace(a.headers["x-ir-trace-id"]).batch_size for a in answers]
    assert all(size is not None and size > 1 for size in batched), batched
    assert sink.by_trace(alone.headers["x-ir-trace-id"]).batch_size == 1.0
    assert "sparseguard_engine_batch_size_count 4.0" in metrics
