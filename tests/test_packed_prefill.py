"""`runtime.packed`: prompts prefilled in one packed pass, each at its own level and from its
own restored prefix, give each prompt's logits, KV and signals of its prefill alone; no prompt
attends to another's tokens; prompts past one pass's token cap prefill in several."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sparse_engine.runtime import kernels, packed
from sparse_engine.runtime.batch import KVSlots
from sparse_engine.runtime.generation import GenerationRequest
from sparse_engine.runtime.packed import Segment, _passes, prefill_packed
from sparse_engine.runtime.scheduler import Scheduler
from sparse_engine.sparsity.plan import Level
from sparse_engine.sparsity.recorder import SignalRecorder
from tests.test_scheduler import LEVELS as MIXED
from tests.test_scheduler import _engine, _request, _same, _together
from tests.tiny import sample_texts, tiny_engine

LEVELS = [Level.BALANCED, Level.DENSE, Level.AGGRESSIVE]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_packed_prefill_equals_each_prompt_alone(family: str) -> None:
    engine = tiny_engine(cache=False, family=family)
    engine.enable_fast_path("float32", kernels.load(), max_len=256)
    fast = engine.fast
    assert fast is not None
    texts = zip(sample_texts(3), (40, 7, 23), strict=True)
    prompts = [engine.lm.tokenizer(t)["input_ids"][:n] for t, n in texts]
    starts = [0, 3, 0]  # the second has its first 3 tokens in its slot already
    plans = [engine.plan(level) for level in LEVELS]
    alone = []
    for ids, start, plan in zip(prompts, starts, plans, strict=True):
        recorder = SignalRecorder(engine.lm.num_layers, plan.silence_thresholds)
        fast.reset()
        if start:
            fast.prefill(ids[:start], plan)
        logits = fast.prefill(ids[start:], plan, recorder)
        kv = fast.keys[:, :, : len(ids)].clone(), fast.values[:, :, : len(ids)].clone()
        alone.append((logits, kv, recorder))
    slots = KVSlots(fast, 3)
    segments = []
    for slot, (ids, start, plan) in enumerate(zip(prompts, starts, plans, strict=True)):
        if start:
            slots.bind(slot, 0).prefill(ids[:start], plan)
        recorder = SignalRecorder(engine.lm.num_layers, plan.silence_thresholds)
        limits = fast._thresholds(plan)
        segments.append(Segment(slot, start, ids[start:], limits, recorder, None))
    logits = prefill_packed(slots, segments)
    fast.unbind()
    for slot, (want, seg, ids) in enumerate(zip(alone, segments, prompts, strict=True)):
        torch.testing.assert_close(logits[slot], want[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(slots.keys[:, slot, :, : len(ids)], want[1][0])
        torch.testing.assert_close(slots.values[:, slot, :, : len(ids)], want[1][1])
        assert seg.recorder is not None
        got, expected = seg.recorder.summary(), want[2].summary()
        for name in ("sparsity_per_layer", "silence_rate_per_layer", "step_sparsity"):
            torch.testing.assert_close(getattr(got, name), getattr(expected, name))


def test_a_packed_prefill_refuses_an_empty_or_too_long_segment() -> None:
    engine = tiny_engine(cache=False)
    engine.enable_fast_path("float32", None, max_len=16)
    assert engine.fast is not None
    slots = KVSlots(engine.fast, 2)
    limits = engine.fast._thresholds(engine.plan(Level.BALANCED))
    with pytest.raises(ValueError, match="at least one token"):
        prefill_packed(slots, [Segment(0, 0, [], limits, None, None)])
    with pytest.raises(ValueError, match="16 tokens"):
        prefill_packed(slots, [Segment(0, 10, list(range(1, 8)), limits, None, None)])


def test_packed_passes_hold_at_most_the_token_cap_and_a_longer_prompt_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def opened(size: int) -> Any:
        return (size, None, Segment(0, 0, [1] * size, torch.empty(0), None, None))

    monkeypatch.setattr(packed, "PACKED_TOKENS", 1000)
    sizes = [600, 300, 200, 1500, 100, 1000]
    groups = _passes([opened(n) for n in sizes])
    assert [[item[0] for item in g] for g in groups] == [[600, 300], [200], [1500], [100], [1000]]


def test_prompts_past_one_packed_pass_prefill_in_several(monkeypatch: pytest.MonkeyPatch) -> None:
    """Passes capped at 12 tokens: the scheduler's five prompts prefill in several packed
    passes, each as alone (tokens, signals, readout)."""
    monkeypatch.setattr(packed, "PACKED_TOKENS", 12)
    engine = _engine("llama", "native")
    jobs: list[tuple[GenerationRequest, Any]] = [(_request(i), lv) for i, lv in enumerate(MIXED)]
    alone = [engine.generate(request, level).result() for request, level in jobs]
    scheduler = Scheduler(max_batch=8, batch_from=2)
    try:
        for want, sink in zip(alone, _together(scheduler, engine, jobs), strict=True):
            _same(want, sink.result())
        assert scheduler.packed == len(jobs)
    finally:
        scheduler.close()
