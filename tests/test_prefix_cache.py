"""Prefix KV reuse, cancellation and teacher-forced scoring on a tiny model."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from sparse_engine.calibration.allocation import thresholds_for, uniform_targets
from sparse_engine.calibration.stats import collect_stats
from sparse_engine.runtime.engine import Engine, GenerationRequest
from sparse_engine.runtime.prefix_cache import CacheKey, PrefixCache, SparseCacheMismatchError
from sparse_engine.runtime.scoring import score_answer
from sparse_engine.sparsity.plan import Level, SparsityPlan
from sparse_engine.sparsity.recorder import SignalSummary
from tests.tiny import sample_texts, tiny_model

SYSTEM = "You are a careful assistant. Answer briefly and cite nothing. " * 2


def engine_with_plans(cache: PrefixCache[DynamicCache] | None) -> Engine:
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


def other(question: str) -> GenerationRequest:
    messages = [{"role": "user", "content": question}]
    return GenerationRequest(messages=messages, max_new_tokens=6, ignore_eos=True)


def same_signals(a: SignalSummary | None, b: SignalSummary | None) -> None:
    assert a is not None and b is not None
    assert a.sparsity_ratio == pytest.approx(b.sparsity_ratio, abs=1e-6)
    assert a.sparsity_per_layer == pytest.approx(b.sparsity_per_layer, abs=1e-6)
    assert a.gate_confidence == pytest.approx(b.gate_confidence, abs=1e-6)
    assert a.gate_entropy == pytest.approx(b.gate_entropy, abs=1e-6)
    assert a.silence_rate_per_layer == pytest.approx(b.silence_rate_per_layer, abs=1e-6)
    assert a.activation_stability_pct == pytest.approx(b.activation_stability_pct, abs=1e-4)


@pytest.mark.parametrize("fast", [False, True], ids=["reference", "fast"])
@pytest.mark.parametrize("level", [Level.DENSE, Level.BALANCED])
def test_a_reused_prefix_reports_the_signals_of_an_uncached_prefill(
    level: Level, fast: bool
) -> None:
    """Shared-system requests interleaved with another: the third reuses the first's system
    prompt (not only the last request's), with the tokens and every signal of a run without
    reuse, so per-request signals do not depend on what happened to be cached."""
    cached = engine_with_plans(PrefixCache())
    plain = engine_with_plans(None)
    if fast:
        cached.enable_fast_path()
        plain.enable_fast_path()
    cached.generate(ask("first question?"), level).result()
    cached.generate(other("something else entirely, no system prompt"), level).result()
    third = cached.generate(ask("third question?"), level).result()
    reference = plain.generate(ask("third question?"), level).result()
    assert third.cached_tokens > len(SYSTEM) // 2 and reference.cached_tokens == 0
    assert third.token_ids == reference.token_ids
    same_signals(third.signals, reference.signals)
    store = cached.fast_prefixes if fast else cached.prefix_cache
    assert store is not None and len(store) == 4  # the system prompt and three whole prompts


def test_a_continued_conversation_reuses_the_whole_earlier_prompt() -> None:
    engine = engine_with_plans(PrefixCache())
    first = ask("first question?")
    answer = engine.generate(first, Level.BALANCED).result()
    assert first.messages is not None
    turns = [*first.messages, {"role": "assistant", "content": answer.text}]
    follow = GenerationRequest(
        messages=[*turns, {"role": "user", "content": "and then?"}], max_new_tokens=4
    )
    again = engine.generate(follow, Level.BALANCED).result()
    assert again.cached_tokens == answer.prompt_tokens


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
        cache.lookup(CacheKey(lm.model_id, "v2", "dense"), [*engine.encode_text("x" * 150), 0])
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
