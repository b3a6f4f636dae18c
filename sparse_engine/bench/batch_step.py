"""What a decode step of B sequences costs each way the scheduler could run it: the compiled
kernel row by row (each row reads only its kept weight rows), or one batched product that
reads every weight row once (`runtime.batch`), with the rows at one level or split over two;
and the share of weight rows at least one row of the batch keeps (what a union-of-kept-rows
product would read). Beside it, what a prompt's prefill costs by its length, and what a burst of
B prompts arriving together costs before the last of them gets its first token, prefilled one
after another or in one packed pass (`runtime.packed`, what the scheduler runs): that burst
bounds the time to first token under load."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sparse_engine.runtime.batch import BatchStep, KVSlots, Row
from sparse_engine.runtime.engine import Engine
from sparse_engine.runtime.fastpath import FastDecoder
from sparse_engine.runtime.packed import Segment, prefill_packed
from sparse_engine.sparsity.plan import SparsityPlan


@dataclass(frozen=True, slots=True)
class StepRow:
    batch: int
    row_by_row_ms: float  # B compiled-kernel steps
    batched_ms: float  # one batched step, every row at the plan's level
    mixed_ms: float  # one batched step, half the rows dense (per-row thresholds)
    union_read_share: float  # weight rows of the down projection some row keeps

    @property
    def best(self) -> str:
        return "batched" if self.batched_ms < self.row_by_row_ms else "row by row"


@dataclass(frozen=True, slots=True)
class PrefillRow:
    tokens: int
    ms: float  # the fastest of the repeats

    @property
    def ms_per_token(self) -> float:
        return self.ms / self.tokens


def prefill_speed(
    engine: Engine, plan: SparsityPlan, ids: list[int], lengths: list[int], repeats: int = 3
) -> list[PrefillRow]:
    """Per length n: one prompt of the first n of `ids` (real tokens) prefilled alone on the
    fast path, the fastest of `repeats`."""
    fast = _fast(engine)
    if max(lengths) > min(len(ids), fast.max_len):
        raise ValueError(f"prefill lengths go up to {min(len(ids), fast.max_len)} tokens here")
    out = []
    for n in lengths:
        took = []
        for _ in range(repeats + 1):  # the first warms up
            fast.reset()
            started = time.perf_counter()
            fast.prefill(ids[:n], plan)
            took.append(time.perf_counter() - started)
        out.append(PrefillRow(n, min(took[1:]) * 1000))
    fast.reset()
    return out


@dataclass(frozen=True, slots=True)
class Burst:
    prompts: int
    tokens: int
    one_by_one_ms: float  # median: each prompt's prefill alone, one after another
    packed_ms: float  # median: one packed prefill of them all (`runtime.packed`)


def burst_speed(
    engine: Engine, plan: SparsityPlan, prompts: list[list[int]], repeats: int = 3
) -> Burst:
    """Milliseconds to prefill `prompts` arriving together, one after another and in one packed
    pass, alternating the two `repeats` times (after one warm-up of each) so that a machine's
    drift falls on both alike."""
    fast = _fast(engine)
    slots = KVSlots(fast, len(prompts))
    limits = fast._thresholds(plan)
    segments = [Segment(slot, 0, ids, limits, None, None) for slot, ids in enumerate(prompts)]

    def one_by_one() -> None:
        for ids in prompts:
            fast.reset()
            fast.prefill(ids, plan)

    def packed() -> None:
        prefill_packed(slots, segments)
        fast.unbind()

    times: tuple[list[float], list[float]] = ([], [])
    for round_ in range(repeats + 1):
        for run, kept in ((one_by_one, times[0]), (packed, times[1])):
            started = time.perf_counter()
            run()
            if round_:
                kept.append((time.perf_counter() - started) * 1000)
    fast.reset()
    tokens = sum(map(len, prompts))
    return Burst(len(prompts), tokens, statistics.median(times[0]), statistics.median(times[1]))


def _fast(engine: Engine) -> FastDecoder:
    if engine.fast is None:
        raise ValueError("the batch-step bench needs the fast path (engine fast_path float32)")
    return engine.fast


def batch_step_speed(
    engine: Engine, plan: SparsityPlan, prompts: list[list[int]], sizes: list[int], steps: int = 5
) -> list[StepRow]:
    """Per batch size: mean milliseconds per step (after one warm-up) with `prompts` (token ids,
    one per row, reused round-robin) prefilled into the slots."""
    fast = _fast(engine)
    slots = KVSlots(fast, max(sizes))
    batched = BatchStep(slots)
    dense = SparsityPlan()
    lengths = []
    for slot in range(max(sizes)):
        ids = prompts[slot % len(prompts)]
        slots.bind(slot, 0).prefill(ids, plan)
        lengths.append(len(ids))
    fast.unbind()
    table, dense_table = fast._thresholds(plan), fast._thresholds(dense)
    out = []
    for size in sizes:

        def rows(mixed: bool, size: int = size) -> list[Row]:
            return [
                Row(s, lengths[s], 1, dense_table if mixed and s % 2 else table, None, None)
                for s in range(size)
            ]

        def row_by_row(size: int = size) -> None:
            for s in range(size):
                slots.bind(s, lengths[s]).step(1, plan)

        out.append(
            StepRow(
                size,
                _time(row_by_row, steps),
                _time(lambda: batched(rows(False)), steps),
                _time(lambda: batched(rows(True)), steps),
                _union_share(engine, plan, prompts, size),
            )
        )
    fast.unbind()
    return out


def _time(run: Callable[[], object], steps: int) -> float:
    run()
    took = []
    for _ in range(steps):
        started = time.perf_counter()
        run()
        took.append(time.perf_counter() - started)
    return statistics.mean(took) * 1000


def _union_share(engine: Engine, plan: SparsityPlan, prompts: list[list[int]], size: int) -> float:
    """Over the layers, the share of down-projection inputs kept by at least one of `size`
    rows: each row the last prompt position of one prompt, through the reference hooks."""
    if "down" not in plan.thresholds:
        return 1.0
    kept: dict[int, torch.Tensor] = {}

    def hook(layer: int, threshold: float):  # type: ignore[no-untyped-def]
        def run(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            row = args[0][0, -1].abs() > threshold
            kept[layer] = row if layer not in kept else kept[layer] | row

        return run

    handles = [
        part.get("down").register_forward_pre_hook(hook(part.index, plan.thresholds["down"][i]))
        for i, part in enumerate(engine.lm.layers)
    ]
    try:
        with torch.inference_mode():
            for ids in [prompts[i % len(prompts)] for i in range(size)]:
                engine.lm.model(input_ids=torch.tensor([ids]))
    finally:
        for handle in handles:
            handle.remove()
    return float(torch.stack([k.float().mean() for k in kept.values()]).mean())
