"""What waits for the scheduler (`runtime.scheduler`): generation and probe tickets, the sink
they report to, and how waiting probes are grouped into batched passes."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Protocol

from sparse_engine.runtime.engine import Engine, length_groups
from sparse_engine.runtime.generation import GenerationRequest, GenerationStats
from sparse_engine.runtime.scoring import Probe, score_many
from sparse_engine.sparsity.plan import Level, SparsityPlan


class QueueFullError(Exception):
    """Too many requests are waiting; the caller should retry later."""


class Sink(Protocol):
    """Where a request's output goes, called on the scheduler's thread."""

    def started(self) -> None: ...  # admitted: its prefill begins
    def delta(self, text: str) -> None: ...
    def done(self, stats: GenerationStats) -> None: ...
    def error(self, exc: Exception) -> None: ...


@dataclass(slots=True)
class Ticket:
    request: GenerationRequest
    level: Level | SparsityPlan
    sink: Sink
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass(slots=True)
class ProbeTicket:
    probe: Probe
    level: Level | SparsityPlan
    readout: bool
    sink: Sink
    cancelled: threading.Event = field(default_factory=threading.Event)


Waiting = tuple[ProbeTicket, SparsityPlan]  # a probe and the plan it runs under


def run_probes(engine: Engine, batch: list[Waiting]) -> None:
    """One batched pass over probes that share a plan; each sink gets its statistics (their
    `batch_size` the batch's rows) or the pass's error."""
    for ticket, _ in batch:
        ticket.sink.started()
    probes = [ticket.probe for ticket, _ in batch]
    try:
        found = score_many(engine, probes, batch[0][1], batch[0][0].readout)
    except Exception as exc:
        for ticket, _ in batch:
            ticket.sink.error(exc)
        return
    for (ticket, _), stats in zip(batch, found, strict=True):
        stats.batch_size = float(len(batch))
        ticket.sink.done(stats)


def probe_batches(group: list[Waiting], budget: int) -> list[list[Waiting]]:
    """Batches of probes of similar length (`length_groups`: on CPU a padded row costs its
    padded tokens), each split where its padded size (rows x the longest) would pass `budget`
    tokens (a longer probe runs alone)."""
    sizes = [_probe_tokens(ticket.probe) for ticket, _ in group]
    batches: list[list[Waiting]] = []
    for similar in length_groups(sizes):
        current: list[Waiting] = []
        for i in similar:  # shortest first, so the newest row is the longest
            if current and sizes[i] * (len(current) + 1) > budget:
                batches.append(current)
                current = []
            current.append(group[i])
        batches.append(current)
    return batches


def _probe_tokens(probe: Probe) -> int:
    """A probe's length, its prompt estimated at 4 characters a token (not yet encoded)."""
    chars = sum(len(m["content"]) for m in probe.messages)
    return chars // 4 + len(probe.answer_ids)
