"""The load part of `sparseguard bench batch-step`: N concurrent clients sending real prompts
(ShareGPT first turns, the evaluation half) through the engine's scheduler alone, with the
prompts that start together prefilled in one packed pass and one by one, the two alternated
round by round (which one goes first alternates too) so that a machine whose speed drifts
weighs on both alike. Per way: its median round's figures; per round: packed over one by one
in tok/s and time to first token at p99."""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

from services.cli.bench_load import LoadRow, engine_alone, run_clients, summarise
from services.cli.common import emit
from sparse_engine.runtime.engine import Engine
from sparse_engine.runtime.generation import GenerationRequest, Message
from sparse_engine.runtime.scheduler import Scheduler
from sparse_engine.sparsity.plan import Level

log = logging.getLogger(__name__)
WAYS = {"packed": 2, "one by one": 1 << 30}  # the scheduler's pack_from


def packing_rounds(
    engine: Engine,
    level: Level,
    prompts: list[list[Message]],
    clients: int,
    rounds: int,
    tokens: int = 64,
    batch_from: int = 4,
) -> dict[str, Any]:
    """`rounds` rounds of 2 x `clients` requests each way (64-token greedy answers with the
    trust readout, as the gateway asks)."""
    scheduler = Scheduler(max_batch=clients, max_waiting=clients, batch_from=batch_from)
    scheduler.call(lambda: scheduler.attach(engine)).result()

    def send(i: int) -> Any:
        request = GenerationRequest(
            messages=prompts[i % len(prompts)], max_new_tokens=tokens, temperature=0.0,
            readout=True,
        )  # fmt: skip
        return engine_alone(scheduler, request, level)

    runs: dict[str, list[LoadRow]] = {way: [] for way in WAYS}
    try:
        send(0)  # warm-up
        for r in range(rounds):
            order = list(WAYS) if r % 2 == 0 else list(reversed(WAYS))
            for way in order:
                scheduler.call(partial(setattr, scheduler, "pack_from", WAYS[way])).result()
                log.info("load: %d clients, prefills %s, round %d", clients, way, r + 1)
                runs[way].append(summarise(way, clients, *run_clients(send, clients, 2 * clients)))
    finally:
        scheduler.close()
    packed, alone = runs["packed"], runs["one by one"]
    return {
        "clients": clients,
        "rows": [_median(found).to_dict() for found in runs.values()],
        "round_tok_s_ratio": [
            round(p.tokens_per_s / a.tokens_per_s, 2) for p, a in zip(packed, alone, strict=True)
        ],
        "round_ttft_p99_ms": [
            (p.ttft_p99_ms, a.ttft_p99_ms) for p, a in zip(packed, alone, strict=True)
        ],
    }


def _median(found: list[LoadRow]) -> LoadRow:
    return sorted(found, key=lambda run: run.tokens_per_s)[(len(found) - 1) // 2]


def print_packing(result: dict[str, Any]) -> None:
    emit(
        f"scheduler alone, {result['clients']} clients, prefills packed vs one by one "
        "(median round of each)"
    )
    emit(f"{'prefills':12} {'tok/s':>7} {'ttft p50':>9} {'p99':>7} {'tpot p50':>9} {'p99':>7}")
    for r in result["rows"]:
        emit(
            f"{r['target']:12} {r['tokens_per_s']:>7.1f} {r['ttft_p50_ms']:>9.0f} "
            f"{r['ttft_p99_ms']:>7.0f} {r['tpot_p50_ms']:>9.1f} {r['tpot_p99_ms']:>7.1f}"
        )
    ratios = ", ".join(f"{x:.2f}x" for x in result["round_tok_s_ratio"])
    ttft = ", ".join(f"{p:.0f} vs {a:.0f}" for p, a in result["round_ttft_p99_ms"])
    emit(f"per round, packed over one by one: tok/s {ratios}; ttft p99 ms {ttft}")
