"""Prefix KV reuse, cancellation and teacher-forced scoring on a tiny model."""

from __future__ import annotations

import pytest
import torch

from sparse_engine.calibration.allocation import thresholds_for, uniform_targets
from sparse_engine.calibration.stats import collect_stats
from sparse_engine.runtime.engine import Engine, GenerationRequest
from sparse_engine.runtime.prefix_cache import CacheKey, PrefixCache, SparseCacheMismatchError
from sparse_engine.runtime.scoring import score_answer
from sparse_engine.sparsity.plan import Level, SparsityPlan
from tests.tiny import sample_texts, tiny_model

SYSTEM = "You are a careful assistant. Answer briefly and cite nothing. " * 2


def engine_with_plans(cache: PrefixCache | None) -> Engine:
    lm = tiny_model("llama")
    batches = [torch.tensor([lm.tokenizer(t)["input_ids"][:96]]) for t in sample_texts(6)]
    stats = collect_stats(lm.model, lm.layers, batches, ("down",))
    plans = {
        level: SparsityPlan(
            level,
            thresholds_for(stats, uniform_targets(stats, ("down",), target)),
            calibration_version=f"v-{level.value}",
        )
        for level, target in ((Level.CONSERVATIVE, 0.3), (Level.BALANCED, 0.5))
    }
    return Engine(lm, plans, cache)


def ask(question: str) -> GenerationRequest:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return GenerationRequest(messages=messages, max_new_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("level", [Level.DENSE, Level.BALANCED])
def test_shared_prefix_is_reused_and_output_unchanged(level: Level) -> None:
    cached = engine_with_plans(PrefixCache())
    plain = engine_with_plans(None)
    cached.generate(ask("first question?"), level).result()
    second = cached.generate(ask("second question?"), level).result()
    reference = plain.generate(ask("second question?"), level).result()
    assert second.cached_tokens > len(SYSTEM) // 2
    assert 0.5 < second.cache_hit_rate < 1.0
    assert second.token_ids == reference.token_ids


def test_prefix_from_another_level_is_never_reused() -> None:
    engine = engine_with_plans(PrefixCache())
    engine.generate(ask("first?"), Level.BALANCED).result()
    other = engine.generate(ask("second?"), Level.CONSERVATIVE).result()
    assert other.cached_tokens == 0 and other.cache_mismatch
    assert engine.prefix_cache is not None and engine.prefix_cache.mismatches == 1
    again = engine.generate(ask("third?"), Level.CONSERVATIVE).result()
    assert again.cached_tokens > 0 and not again.cache_mismatch


def test_lookup_raises_on_version_mismatch_and_bounds_tokens() -> None:
    lm = tiny_model("llama")
    engine = Engine(lm, {}, PrefixCache(max_tokens=200))
    engine.generate(GenerationRequest(prompt="x" * 150, max_new_tokens=1)).result()
    cache = engine.prefix_cache
    assert cache is not None and len(cache) == 1
    with pytest.raises(SparseCacheMismatchError, match="v2"):
        cache.lookup(CacheKey(lm.model_id, "v2", "dense"), engine.encode_text("x" * 150))
    engine.generate(GenerationRequest(prompt="y" * 150, max_new_tokens=1)).result()
    assert len(cache) == 1  # the older entry was evicted to stay under 200 tokens


def test_cancel_stops_generation_with_stats() -> None:
    engine = engine_with_plans(None)
    generation = engine.generate(
        GenerationRequest(prompt="abc", max_new_tokens=50, ignore_eos=True)
    )
    for n, _ in enumerate(generation):
        if n == 2:
            generation.cancel()
    stats = generation.stats
    assert stats is not None and stats.finish_reason == "cancelled"
    assert stats.completion_tokens < 50


def test_score_answer_matches_generation_signals() -> None:
    engine = engine_with_plans(None)
    messages = [{"role": "user", "content": "Say something."}]
    request = GenerationRequest(
        messages=messages, max_new_tokens=8, ignore_eos=True, measure_drift=True
    )
    generated = engine.generate(request, Level.BALANCED).result()
    scored = score_answer(engine, messages, generated.text, Level.BALANCED, measure_drift=True)
    assert scored.signals is not None and generated.signals is not None
    assert scored.completion_tokens >= 1
    assert scored.signals.sparsity_ratio == pytest.approx(
        generated.signals.sparsity_ratio, abs=0.05
    )
    assert len(scored.signals.step_sparsity) == scored.completion_tokens
    assert scored.semantic_drift_kl is not None and scored.semantic_drift_kl > 0
    dense = score_answer(engine, messages, generated.text, Level.DENSE, measure_drift=True)
    assert dense.semantic_drift_kl == 0.0 and dense.signals is not None
    assert dense.signals.sparsity_ratio == 0.0
