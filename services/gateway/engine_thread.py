"""The gateway's side of the engine's scheduler (`sparse_engine.runtime.scheduler`): the
engine runs on the scheduler's one thread, so the event loop never blocks on the model, and
each request's output comes back to its event loop as a stream of events. Generations join
the running batch; proxy probes waiting at a step boundary run as one batched pass; other
engine work (loading the model) runs between two steps. A full waiting queue is refused at
once (429) instead of piling up. The model is best loaded on the engine thread too (`call`):
PyTorch's OpenMP thread pool belongs to the thread that runs parallel work, and a model loaded
on one thread and run on another decoded 1.7x slower on 2 cores (`sparseguard bench
gateway`, README "The gateway")."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from services.config import EngineSettings
from sparse_engine.runtime.engine import Engine
from sparse_engine.runtime.generation import GenerationRequest, GenerationStats
from sparse_engine.runtime.scheduler import Scheduler
from sparse_engine.runtime.scoring import Probe
from sparse_engine.runtime.tickets import QueueFullError
from sparse_engine.sparsity.plan import Level, SparsityPlan

T = TypeVar("T")
__all__ = ["EngineJob", "EngineWorker", "QueueFullError"]


@dataclass(slots=True)
class EngineJob:
    """One request's work on the engine thread and the events it sends back (a scheduler
    sink: `started`, `delta`, `done`, `error` are called on the engine thread)."""

    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    enqueued_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None
    finished_at: float | None = None

    async def events(self) -> AsyncIterator[tuple[str, Any]]:
        """("delta", text)* then ("done", result) or ("error", exception)."""
        while True:
            kind, value = await self.out.get()
            yield kind, value
            if kind != "delta":
                return

    @property
    def queue_s(self) -> float:
        return (self.started_at or time.perf_counter()) - self.enqueued_at

    @property
    def engine_s(self) -> float:
        """From joining the running batch to the statistics, on the engine thread."""
        start = self.started_at or self.enqueued_at
        return (self.finished_at or time.perf_counter()) - start

    def started(self) -> None:
        self.started_at = time.perf_counter()

    def delta(self, text: str) -> None:
        self._post(("delta", text))

    def done(self, stats: GenerationStats) -> None:
        self.finished_at = time.perf_counter()
        self._post(("done", stats))

    def error(self, exc: Exception) -> None:
        self._post(("error", exc))

    def _post(self, item: tuple[str, Any]) -> None:
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)
        except RuntimeError:  # the request's event loop is gone; nobody is listening
            self.cancel.set()


class EngineWorker:
    def __init__(self, queue_size: int, engine: EngineSettings | None = None) -> None:
        cfg = engine or EngineSettings()
        self.scheduler = Scheduler(
            cfg.max_batch, cfg.kv_tokens, queue_size, cfg.batch_from, cfg.pack_from
        )

    @property
    def depth(self) -> int:
        return self.scheduler.depth

    @property
    def running(self) -> int:
        return self.scheduler.running

    async def attach(self, engine: Engine) -> None:
        """Serve `engine` from now on (set up on the engine thread)."""
        await asyncio.wrap_future(self.call(lambda: self.scheduler.attach(engine)))

    def generate(self, request: GenerationRequest, plan: Level | SparsityPlan) -> EngineJob:
        """Join the running batch with `request`; raises QueueFullError."""
        job = EngineJob(asyncio.get_running_loop())
        self.scheduler.submit(request, plan, job, job.cancel)
        return job

    def probe(self, probe: Probe, plan: Level | SparsityPlan, readout: bool) -> EngineJob:
        """Queue a teacher-forced probe (proxy mode); the probes waiting at a step boundary
        run as one batched pass. Raises QueueFullError."""
        job = EngineJob(asyncio.get_running_loop())
        self.scheduler.probe(probe, plan, job, readout, job.cancel)
        return job

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run `fn` on the engine thread, after the work already queued; its result or error
        arrives in the future."""
        return self.scheduler.call(fn)

    def close(self, timeout: float = 5.0) -> None:
        self.scheduler.close(timeout)
