"""The scheduler's timing: a request's decode tokens/s ends with its last token, before the
batched drift pass that measures its KL drift (a 0.5 s delay injected into that pass stays out
of it)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from sparse_engine.runtime.generation import GenerationRequest
from sparse_engine.runtime.scheduler import Scheduler
from sparse_engine.sparsity.plan import Level
from tests.test_scheduler import _engine, _request, _together


@pytest.fixture
def scheduler() -> Iterator[Scheduler]:
    made = Scheduler(max_batch=8, batch_from=2)
    yield made
    made.close()


def test_the_batched_drift_pass_is_not_counted_as_decode_time(scheduler: Scheduler) -> None:
    engine = _engine("llama", "fallback")
    measure = engine.semantic_drift_many

    def slow(items: list[tuple[list[int], list[int], torch.Tensor]]) -> list[float]:
        time.sleep(0.5)
        return measure(items)

    engine.semantic_drift_many = slow  # type: ignore[method-assign]
    jobs: list[tuple[GenerationRequest, Any]] = [
        (_request(i, measure_drift=True, max_new_tokens=8), Level.AGGRESSIVE) for i in range(2)
    ]
    for sink in _together(scheduler, engine, jobs):
        stats = sink.result()
        decode_s = (stats.completion_tokens - 1) / stats.decode_tokens_per_s
        wall = sink.ended - sink.began
        assert stats.semantic_drift_kl is not None
        assert stats.time_to_first_token_s + decode_s < wall - 0.45
