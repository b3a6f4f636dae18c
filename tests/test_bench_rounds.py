"""`sparseguard bench gateway --rounds N`: client counts run interleaved, each reports its
median round, and every round's ratio pairs it with the first count's run of that round."""

from __future__ import annotations

import statistics
import threading
import time

from services.cli.bench_load import Sample, _rounds


def test_rounds_interleave_counts_and_report_the_median_round() -> None:
    calls: list[int] = []
    lock = threading.Lock()

    def send(i: int) -> Sample:
        with lock:
            calls.append(i)
        time.sleep(0.01)
        return Sample(True, 0.001, 0.01, 5)

    rows = _rounds("engine alone", [(1, 3), (2, 4)], 3, send)
    assert len(calls) == 3 * (3 + 4)
    # Interleaved: each round sends prompts 0..2 (1 client), then 0..3 (2 clients).
    assert sorted(calls[:3]) == [0, 1, 2] and sorted(calls[3:7]) == [0, 1, 2, 3]
    assert [r["clients"] for r in rows] == [1, 2]
    for row in rows:
        assert len(row["round_tokens_per_s"]) == 3
        assert row["tokens_per_s"] == statistics.median(row["round_tokens_per_s"])
    assert rows[0]["round_ratios"] == [1.0, 1.0, 1.0]
    first, second = rows[0]["round_tokens_per_s"], rows[1]["round_tokens_per_s"]
    assert rows[1]["round_ratios"] == [round(b / a, 2) for a, b in zip(first, second, strict=True)]
    assert all(ratio > 1.2 for ratio in rows[1]["round_ratios"])  # 2 clients overlap their sleeps
