"""Continuous batching: one thread owns the engine and runs every admitted sequence a step at a
time. New requests join at step boundaries (their prompts are prefilled between two steps, the
fast-path prompts that start together in one packed pass: `runtime.packed`), finished ones
leave, and the fast-path sequences of every level step together (`runtime.batch`);
reference-path sequences (Top-K plans, a plan-A mask, prompts longer than the fast path holds)
step one after another in the same loop. Each sequence keeps its own sampling, stops, recorder
and readout (`runtime.sequence`), so its signals are what it would have got alone.

Admission: at most `max_batch` sequences run, holding at most `kv_tokens` tokens between them
(prompt plus max_new_tokens each; one longer request runs when it would run alone); the rest
wait, and a submit past `max_waiting` waiting raises QueueFullError. Other engine work
(`call`) runs between steps, on the same thread: the engine is not thread-safe, and PyTorch's
OpenMP pool belongs to the thread that runs it."""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from sparse_engine.runtime.batch import BatchStep, KVSlots, Row
from sparse_engine.runtime.engine import Engine
from sparse_engine.runtime.generation import GenerationRequest
from sparse_engine.runtime.packed import prefill_sequences
from sparse_engine.runtime.prefill import FastKV, ReferenceKV
from sparse_engine.runtime.scoring import Probe
from sparse_engine.runtime.sequence import Sequence
from sparse_engine.runtime.tickets import (
    ProbeTicket,
    QueueFullError,
    Sink,
    Ticket,
    Waiting,
    probe_batches,
    run_probes,
)
from sparse_engine.sparsity.plan import Level, SparsityPlan

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(slots=True)
class _Live:
    ticket: Ticket
    seq: Sequence
    path: FastKV | ReferenceKV
    limits: torch.Tensor | None  # the fast path's threshold table; None on the reference path

    @property
    def tokens(self) -> int:
        return len(self.seq.prompt_ids) + self.seq.request.max_new_tokens


@dataclass(slots=True)
class _Call:
    fn: Callable[[], Any]
    future: concurrent.futures.Future[Any]


class Scheduler:
    def __init__(
        self,
        max_batch: int = 16,
        kv_tokens: int = 16384,
        max_waiting: int = 16,
        batch_from: int = 4,
        pack_from: int = 2,
    ) -> None:
        self.max_batch, self.kv_tokens, self.max_waiting = max_batch, kv_tokens, max_waiting
        # From this many fast-path sequences a step runs as one batched product; fewer step
        # row by row on the compiled kernel, which reads only each row's kept weight rows
        # (`sparseguard bench batch-step` measures where one overtakes the other).
        self.batch_from = batch_from
        # From this many fast-path prompts starting at one boundary they prefill in one packed
        # pass (`runtime.packed`); fewer prefill one by one.
        self.pack_from = pack_from
        self.engine: Engine | None = None  # set (`attach`) before the first submit
        self._inbox: queue.SimpleQueue[Ticket | ProbeTicket | _Call | None] = queue.SimpleQueue()
        self._waiting: deque[Ticket] = deque()
        self._probes: list[ProbeTicket] = []
        self._pending = 0  # submitted, not yet admitted (read from other threads)
        self._lock = threading.Lock()
        self._fast: list[_Live] = []  # on the fast path; index = KV slot
        self._reference: list[_Live] = []
        self._slots: KVSlots | None = None
        self._batched: BatchStep | None = None
        self.steps = 0  # decode steps run, and the rows they ran (mean batch = rows / steps)
        self.rows = 0
        self.packed = 0  # prompts prefilled in a packed pass with others
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Requests waiting to start."""
        return self._pending

    @property
    def running(self) -> int:
        return len(self._fast) + len(self._reference)

    def attach(self, engine: Engine) -> None:
        """Serve `engine` (call on the scheduler's thread, through `call`, before submitting)."""
        self.engine = engine
        if engine.fast is not None:
            self._slots = KVSlots(engine.fast, self.max_batch)
            if BatchStep.runs(engine.fast.dtype):
                self._batched = BatchStep(self._slots)

    def submit(
        self,
        request: GenerationRequest,
        level: Level | SparsityPlan,
        sink: Sink,
        cancelled: threading.Event | None = None,
    ) -> Ticket:
        """Queue `request`; its output goes to `sink`. Setting `cancelled` (the ticket's)
        stops it after its current step."""
        self._reserve()
        ticket = Ticket(request, level, sink, cancelled or threading.Event())
        self._inbox.put(ticket)
        return ticket

    def probe(
        self,
        probe: Probe,
        level: Level | SparsityPlan,
        sink: Sink,
        readout: bool = False,
        cancelled: threading.Event | None = None,
    ) -> ProbeTicket:
        """Queue a teacher-forced probe of a given answer (`runtime.scoring`); the probes
        waiting at a step boundary run as batched passes per plan (`probe_batches`)."""
        self._reserve()
        ticket = ProbeTicket(probe, level, readout, sink, cancelled or threading.Event())
        self._inbox.put(ticket)
        return ticket

    def _reserve(self) -> None:
        with self._lock:
            if self._pending >= self.max_waiting:
                raise QueueFullError
            self._pending += 1

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run `fn` on the scheduler's thread between two steps."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._inbox.put(_Call(fn, future))
        return future

    def close(self, timeout: float = 5.0) -> None:
        self._inbox.put(None)
        self._thread.join(timeout)

    def _admitted(self) -> None:
        with self._lock:
            self._pending -= 1

    def _loop(self) -> None:
        while True:
            block = not self.running and not self._waiting and not self._probes
            try:
                item = self._inbox.get(block=block)
                while True:
                    if item is None:
                        return
                    self._take(item)
                    item = self._inbox.get_nowait()
            except queue.Empty:
                pass
            self._admit()
            if self._probes:
                self._run_probes()
            if self.running:
                self._step()

    def _take(self, item: Ticket | ProbeTicket | _Call) -> None:
        if isinstance(item, Ticket):
            self._waiting.append(item)
            return
        if isinstance(item, ProbeTicket):
            self._probes.append(item)
            return
        try:
            item.future.set_result(item.fn())
        except Exception as exc:
            item.future.set_exception(exc)

    def _admit(self) -> None:
        """Start waiting requests while the batch and the token budget allow: fast-path
        prompts that start together prefill packed (`runtime.packed`), the rest one by one."""
        held = sum(live.tokens for live in (*self._fast, *self._reference))
        fresh: list[tuple[Ticket, Sequence]] = []
        while self._waiting and self.running + len(fresh) < self.max_batch:
            ticket = self._waiting[0]
            need = ticket.request.max_new_tokens  # the prompt is counted once it is encoded
            if (self.running or fresh) and held + need > self.kv_tokens:
                break
            self._waiting.popleft()
            self._admitted()
            if ticket.cancelled.is_set():
                continue
            seq = self._open(ticket)
            if seq is not None:
                fresh.append((ticket, seq))
                held += len(seq.prompt_ids) + seq.request.max_new_tokens
        packed = [(t, seq) for t, seq in fresh if seq.fast is not None and self._slots is not None]
        packing = len(packed) >= max(self.pack_from, 2)
        if packing:
            self._start_packed(packed)
        for ticket, seq in fresh:
            if not packing or seq.fast is None:
                self._start(ticket, seq)

    def _open(self, ticket: Ticket) -> Sequence | None:
        engine = self.engine
        assert engine is not None, "attach an engine before submitting"
        ticket.sink.started()
        try:
            return engine.start(ticket.request, engine.plan(ticket.level), ticket.cancelled)
        except Exception as exc:
            ticket.sink.error(exc)
            return None

    def _start(self, ticket: Ticket, seq: Sequence) -> None:
        """Prefill `seq` alone and let it run."""
        engine = self.engine
        assert engine is not None
        try:
            if seq.fast is not None and self._slots is not None:
                self._slots.bind(len(self._fast), 0)
            with torch.inference_mode(), engine.passes(seq):
                path = engine.prefill(seq)
            limits = seq.fast._thresholds(seq.plan) if seq.fast is not None else None
        except Exception as exc:
            ticket.sink.error(exc)
            return
        finally:
            if engine.fast is not None:
                engine.fast.unbind()
        self._join([(_Live(ticket, seq, path, limits), seq.prefilled.logits)])

    def _start_packed(self, fresh: list[tuple[Ticket, Sequence]]) -> None:
        """Prefill fast-path prompts packed into the next free slots and let them run."""
        engine, slots = self.engine, self._slots
        assert engine is not None and slots is not None
        seqs = [seq for _, seq in fresh]
        started = prefill_sequences(
            engine, slots, len(self._fast), seqs, lambda i, exc: fresh[i][0].sink.error(exc)
        )
        self.packed += len(started)
        lives = [(_Live(fresh[i][0], seqs[i], kv, limits), out) for i, kv, limits, out in started]
        self._join(lives)

    def _join(self, started: list[tuple[_Live, torch.Tensor]]) -> None:
        """Prefilled sequences join the running batch with their first token."""
        for live, _ in started:
            (self._fast if live.limits is not None else self._reference).append(live)
        accepted = [live for live, logits in started if self._accepted(live, logits, 1)]
        self._finish([live for live in accepted if live.seq.done])

    def _run_probes(self) -> None:
        """Every waiting probe, batched per plan (and readout setting): rows of similar
        length together, at most `kv_tokens` padded tokens a batch (`probe_batches`)."""
        engine = self.engine
        assert engine is not None, "attach an engine before submitting"
        waiting, self._probes = self._probes, []
        groups: dict[tuple[int, bool], list[Waiting]] = {}
        for ticket in waiting:
            self._admitted()
            if ticket.cancelled.is_set():
                continue
            try:
                plan = engine.plan(ticket.level)
            except Exception as exc:
                ticket.sink.error(exc)
                continue
            groups.setdefault((id(plan), ticket.readout), []).append((ticket, plan))
        for group in groups.values():
            for batch in probe_batches(group, self.kv_tokens):
                run_probes(engine, batch)

    def _step(self) -> None:
        engine = self.engine
        assert engine is not None
        fast, n = list(self._fast), len(self._fast)
        try:
            if n:
                logits = self._fast_step(fast)
                for live, row in zip(fast, logits, strict=True):
                    self._accepted(live, row, n)
        except Exception as exc:
            log.error("a batched decode step failed", exc_info=exc)
            for live in fast:
                self._fail(live, exc)
        finally:
            if engine.fast is not None:
                engine.fast.unbind()
        for live in list(self._reference):
            try:
                with torch.inference_mode(), engine.passes(live.seq):
                    assert isinstance(live.path, ReferenceKV)
                    last = live.path.forward([live.seq.token])
                self._accept(live, last, 1)
            except Exception as exc:
                log.error("a reference decode step failed", exc_info=exc)
                self._fail(live, exc)
        self._finish([live for live in (*self._fast, *self._reference) if live.seq.done])

    def _fast_step(self, fast: list[_Live]) -> list[torch.Tensor]:
        """One decode step of every fast-path sequence: batched, or row by row on the compiled
        kernel below `batch_from` sequences (or without a batched step for the weight type)."""
        assert self._slots is not None
        self.steps += 1
        self.rows += len(fast)
        if len(fast) < max(self.batch_from, 2) or self._batched is None:
            out = []
            for slot, live in enumerate(fast):
                seq = live.seq
                decoder = self._slots.bind(slot, seq.length)
                out.append(decoder.step(seq.token, seq.plan, seq.recorder, seq.readout))
            return out
        rows = []
        for slot, live in enumerate(fast):
            seq, limits = live.seq, live.limits
            assert limits is not None, "fast-path sequences carry their threshold table"
            rows.append(Row(slot, seq.length, seq.token, limits, seq.recorder, seq.readout))
        return list(self._batched(rows))

    def _accepted(self, live: _Live, logits: torch.Tensor, batch: int) -> bool:
        """`_accept`, or the sequence fails alone (its sampling raised) and False."""
        try:
            self._accept(live, logits, batch)
        except Exception as exc:
            log.error("choosing a token failed", exc_info=exc)
            self._fail(live, exc)
            return False
        return True

    def _accept(self, live: _Live, logits: torch.Tensor, batch: int) -> None:
        seq = live.seq
        if seq.steps:
            seq.batch_sizes += batch
        delta = seq.accept(logits)
        if seq.done:
            delta += seq.stream.flush()
        if delta:
            live.ticket.sink.delta(delta)

    def _finish(self, done: list[_Live]) -> None:
        """Statistics for the finished sequences, their drift passes batched, and their slots
        given back (the last fast sequence moves into a freed slot, keeping them packed)."""
        if not done:
            return
        ended = time.perf_counter()
        engine = self.engine
        assert engine is not None
        for live in done:
            self._leave(live)
        inputs = [live.seq.drift_input() for live in done]
        wanted = [(i, x) for i, x in enumerate(inputs) if x is not None]
        drifts: list[float | None] = [None] * len(done)  # None: `finish` measures it alone
        try:
            found = engine.semantic_drift_many([x for _, x in wanted])
            for (i, _), value in zip(wanted, found, strict=True):
                drifts[i] = value
        except Exception as exc:
            log.error("the drift pass failed", exc_info=exc)
        for live, drift in zip(done, drifts, strict=True):
            try:
                live.ticket.sink.done(engine.finish(live.seq, drift, ended))
            except Exception as exc:
                live.ticket.sink.error(exc)

    def _leave(self, live: _Live) -> None:
        if live in self._reference:
            self._reference.remove(live)
            return
        if live not in self._fast:
            return
        slot, last = self._fast.index(live), len(self._fast) - 1
        if slot != last and self._slots is not None:
            moved = self._fast[last]
            self._slots.move(last, slot, moved.seq.length)
            self._fast[slot] = moved
        self._fast.pop()

    def _fail(self, live: _Live, exc: Exception) -> None:
        self._leave(live)
        live.seq.done = True
        live.ticket.sink.error(exc)
