"""`sparseguard bench engine`'s KL-drift figure on the tiny Gemma 3 (the family whose head
dominates the pass): both ways timed for 16 padded answers and for one, and the logits held
by the span-only head are the answer positions' only."""

from __future__ import annotations

from services.cli.bench import BENCH_PROMPT
from services.cli.bench_drift import BATCH, drift_pass_cost
from tests.tiny import tiny_engine


def test_the_drift_pass_is_timed_both_ways_with_the_logits_each_holds() -> None:
    engine = tiny_engine(cache=False, family="gemma3")
    answer = engine.encode_text(" Water flows from the reservoir to the plant.")
    found = drift_pass_cost(engine, BENCH_PROMPT, answer, repeats=1)
    assert found["answer_tokens"] == len(answer)
    per_answer = len(answer) * engine.vocab_size * 4 / 2**20
    for n in (BATCH, 1):
        assert found[f"batch_{n}_span_ms"] > 0 and found[f"batch_{n}_every_position_ms"] > 0
        mib = found[f"batch_{n}_logits_mib"]
        assert mib["span"] == round(n * per_answer, 1)
        assert mib["every_position"] > 2 * mib["span"]  # the prompts are longer than the answer
