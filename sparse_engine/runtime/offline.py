"""Many requests at once for jobs (the golden check, the baseline pass, trust answers and the
trust fit's healthy answers): they run through a scheduler of their own
(`runtime.scheduler`), so their decode steps batch as the gateway's do, and their statistics
come back in the order given.

Every request is queued before the first admission (the submits run on the scheduler's
thread, in one `call`), so the same list of requests always makes the same batches: two runs
of one list under two dense plans give the same tokens, which the golden check's dense-self
control relies on."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence

from sparse_engine.runtime.engine import Engine
from sparse_engine.runtime.generation import GenerationRequest, GenerationStats
from sparse_engine.runtime.scheduler import Scheduler
from sparse_engine.sparsity.plan import Level, SparsityPlan

Job = tuple[GenerationRequest, Level | SparsityPlan]


class _Result:
    """A sink that keeps a request's statistics (or its error)."""

    def __init__(self, progress: Callable[[int], object] | None) -> None:
        self.future: concurrent.futures.Future[GenerationStats] = concurrent.futures.Future()
        self.progress = progress

    def started(self) -> None:
        pass

    def delta(self, text: str) -> None:
        pass

    def done(self, stats: GenerationStats) -> None:
        self.future.set_result(stats)
        if self.progress is not None:
            self.progress(1)

    def error(self, exc: Exception) -> None:
        self.future.set_exception(exc)


def generate_all(
    engine: Engine,
    jobs: Sequence[Job],
    max_batch: int = 16,
    progress: Callable[[int], object] | None = None,
) -> list[GenerationStats]:
    """Each job's statistics, in order; the first failed request's error is raised. The
    engine must not serve anything else meanwhile (it is not thread-safe)."""
    if not jobs:
        return []
    scheduler = Scheduler(max_batch=max_batch, max_waiting=len(jobs))
    results = [_Result(progress) for _ in jobs]

    def queue_all() -> None:
        scheduler.attach(engine)
        for (request, level), result in zip(jobs, results, strict=True):
            scheduler.submit(request, level, result)

    try:
        scheduler.call(queue_all).result()
        return [result.future.result() for result in results]
    finally:
        scheduler.close()
