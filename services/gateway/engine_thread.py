"""The engine runs in one worker thread behind a bounded queue, so the event loop never
blocks on the model. A full queue is refused at once (429) instead of piling up. The model is
best loaded on that thread too (`call`): PyTorch's OpenMP thread pool belongs to the thread
that runs parallel work, and a model loaded on one thread and run on another decoded 1.7x
slower on 2 cores (`sparseguard bench gateway`, README "The gateway")."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)
Emit = Callable[[str], None]
JobFn = Callable[[Emit, threading.Event], Any]
T = TypeVar("T")


class QueueFullError(Exception):
    """The engine queue is full; the caller should retry later."""


@dataclass(slots=True)
class EngineJob:
    run: JobFn
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[tuple[str, Any]]
    cancel: threading.Event = field(default_factory=threading.Event)
    enqueued_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None

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


class EngineWorker:
    def __init__(self, queue_size: int) -> None:
        self._jobs: queue.Queue[EngineJob | _Call[Any] | None] = queue.Queue(maxsize=queue_size)
        self._thread = threading.Thread(target=self._loop, name="engine-worker", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        return self._jobs.qsize()

    def submit(self, run: JobFn) -> EngineJob:
        job = EngineJob(run, asyncio.get_running_loop(), asyncio.Queue())
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise QueueFullError from None
        return job

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run `fn` on the engine thread, after the jobs already queued; its result or error
        arrives in the future."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put(_Call(fn, future))
        return future

    def close(self, timeout: float = 5.0) -> None:
        try:
            self._jobs.put(None, timeout=timeout)
        except queue.Full:
            log.warning("engine worker queue still full at shutdown")
        self._thread.join(timeout)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            if isinstance(job, _Call):
                job.run()
                continue
            if job.cancel.is_set():
                continue
            job.started_at = time.perf_counter()
            self._run(job)

    def _run(self, job: EngineJob) -> None:
        try:
            result = job.run(lambda delta: _post(job, ("delta", delta)), job.cancel)
        except Exception as exc:  # handed to the request, which maps it to an API error
            _post(job, ("error", exc))
        else:
            _post(job, ("done", result))


@dataclass(slots=True)
class _Call(Generic[T]):
    fn: Callable[[], T]
    future: concurrent.futures.Future[T]

    def run(self) -> None:
        try:
            self.future.set_result(self.fn())
        except Exception as exc:
            self.future.set_exception(exc)


def _post(job: EngineJob, item: tuple[str, Any]) -> None:
    try:
        job.loop.call_soon_threadsafe(job.out.put_nowait, item)
    except RuntimeError:  # the request's event loop is gone; nobody is listening
        job.cancel.set()
