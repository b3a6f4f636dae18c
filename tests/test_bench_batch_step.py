"""`sparseguard bench batch-step`'s measurements on a tiny Llama: a step of B sequences each
way, a prompt's prefill by length and a burst of prompts prefilled one after another and
packed, each leaving the fast decoder empty; the scheduler load with prefills packed and one
by one."""

from __future__ import annotations

import pytest

from services.cli.bench_packing import packing_rounds
from sparse_engine.bench.batch_step import batch_step_speed, burst_speed, prefill_speed
from sparse_engine.runtime import kernels
from sparse_engine.sparsity.plan import Level
from tests.tiny import sample_texts, tiny_engine


def test_step_prefill_and_burst_rows_on_a_tiny_model() -> None:
    engine = tiny_engine(cache=False)
    engine.enable_fast_path("float32", kernels.load(), max_len=256)
    assert engine.fast is not None
    plan = engine.plan(Level.BALANCED)
    prompts = [engine.lm.tokenizer(t)["input_ids"][:40] for t in sample_texts(4)]

    steps = batch_step_speed(engine, plan, prompts, [1, 4])
    assert [r.batch for r in steps] == [1, 4]
    assert all(r.row_by_row_ms > 0 and r.batched_ms > 0 and r.mixed_ms > 0 for r in steps)
    assert all(0.0 < r.union_read_share <= 1.0 for r in steps)

    joined = [t for ids in prompts for t in ids]
    rows = prefill_speed(engine, plan, joined, [8, 64], repeats=2)
    assert [r.tokens for r in rows] == [8, 64]
    assert all(r.ms > 0 for r in rows)
    assert engine.fast.length == 0  # left empty: the engine serves on as before
    burst = burst_speed(engine, plan, prompts, repeats=1)
    assert burst.prompts == 4 and burst.tokens == sum(map(len, prompts))
    assert burst.one_by_one_ms > 0 and burst.packed_ms > 0
    assert engine.fast.length == 0

    with pytest.raises(ValueError, match="prefill lengths go up to"):
        prefill_speed(engine, plan, joined[:10], [16])


def test_the_packing_load_runs_both_ways_on_the_same_prompts() -> None:
    engine = tiny_engine(cache=False)
    engine.enable_fast_path("float32", kernels.load(), max_len=256)
    prompts = [[{"role": "user", "content": t[:80]}] for t in sample_texts(4)]
    result = packing_rounds(engine, Level.BALANCED, prompts, clients=2, rounds=2, tokens=4)
    rows = {r["target"]: r for r in result["rows"]}
    assert set(rows) == {"packed", "one by one"}
    for row in rows.values():
        assert row["requests"] == 4 and row["errors"] == 0 and row["tokens_per_s"] > 0
    assert len(result["round_tok_s_ratio"]) == len(result["round_ttft_p99_ms"]) == 2
