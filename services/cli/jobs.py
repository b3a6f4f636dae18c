"""`sparseguard worker`, `sparseguard beat` and `sparseguard jobs ...`: run the Celery worker
and beat, and enqueue, watch or run recalibrations, golden-set checks and trust fits."""

from __future__ import annotations

import argparse
import logging
import os
import time
from typing import Any

from services.cli.common import emit, emit_json
from services.config import Settings
from services.storage.db import make_engine, session_factory, upgrade
from services.storage.models import JobRun
from services.storage.repository import flags
from services.workers import jobs
from services.workers.app import make_celery
from services.workers.tasks import worker_app

log = logging.getLogger(__name__)
POLL_S = 1.0


def register(commands: Any) -> None:
    worker = commands.add_parser("worker", help="run a Celery worker for background jobs")
    worker.add_argument("--concurrency", type=int, default=1, help="jobs at a time (default 1)")
    worker.add_argument("--pool", choices=["prefork", "solo", "threads"], default="prefork")
    worker.set_defaults(handler=run_worker)
    beat = commands.add_parser("beat", help="run the scheduler (one at a time, by a lock)")
    beat.set_defaults(handler=run_beat)

    job = commands.add_parser("jobs", help="background jobs").add_subparsers(
        dest="action", required=True
    )
    recal = job.add_parser("recalibrate", help="recalibrate a level on a worker")
    recal.add_argument("--level", help="sparse level (default: settings)")
    recal.add_argument("--model", help="model (default: settings)")
    _run_options(recal)
    recal.set_defaults(handler=recalibrate)
    check = job.add_parser("golden-check", help="golden-set drift check")
    check.add_argument("--now", action="store_true", help="run it now instead of tonight")
    check.add_argument("--level", action="append", help="level to check (repeatable)")
    check.add_argument("--max-new-tokens", type=int, help="answer length (default: settings)")
    _run_options(check)
    check.set_defaults(handler=golden_check)
    trust = job.add_parser("trust-fit", help="fit the trust model on a worker and publish it")
    trust.add_argument("--n", type=int, help="QA items to answer (default 200)")
    trust.add_argument(
        "--level",
        help="level to answer at, or several joined by ',' (one model each); 'all': every "
        "served level not named before it (default: settings)",
    )
    trust.add_argument("--if-missing", action="store_true", help="skip levels that have one")
    _run_options(trust)
    trust.set_defaults(handler=trust_fit)
    base = job.add_parser(
        "baseline", help="measure the healthy baselines the served calibrations lack, publish"
    )
    _run_options(base)
    base.set_defaults(handler=measure_baseline)
    listing = job.add_parser("list", help="recent jobs")
    listing.add_argument("--limit", type=int, default=20)
    listing.set_defaults(handler=list_jobs)
    show = job.add_parser("show", help="one job as JSON")
    show.add_argument("job_id", type=int)
    show.set_defaults(handler=show_job)
    job.add_parser("flags", help="standing model flags (fine-tune)").set_defaults(
        handler=show_flags
    )


def _run_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--wait", action="store_true", help="wait for the job and print it")
    parser.add_argument(
        "--inline", action="store_true", help="run in this process instead of on a worker"
    )
    parser.add_argument("--timeout", type=float, default=7200.0, help="seconds to --wait")


def run_worker(args: argparse.Namespace, settings: Settings) -> int:
    upgrade(settings.database_url)
    app = worker_app(settings)
    app.worker_main(
        [
            "worker",
            f"--loglevel={settings.log_level}",
            f"--concurrency={args.concurrency}",
            f"--pool={args.pool}",
            f"--queues={settings.jobs.queue}",
            f"--hostname=sparseguard-{os.getpid()}@%h",
            "--without-gossip",
            "--without-mingle",
        ]
    )
    return 0


def run_beat(args: argparse.Namespace, settings: Settings) -> int:
    from services.workers.beat import run_beat

    run_beat(settings, settings.log_level)
    return 0


def recalibrate(args: argparse.Namespace, settings: Settings) -> int:
    params = {"level": args.level or settings.engine.default_level, "model": args.model}
    return _submit(args, settings, "recalibrate", params)


def golden_check(args: argparse.Namespace, settings: Settings) -> int:
    if not (args.now or args.inline):
        app = make_celery(settings)
        schedule = app.conf.beat_schedule["golden-check-nightly"]["schedule"]
        emit(
            f"the golden-set check runs nightly at '{settings.jobs.golden_cron}' (UTC), next in "
            f"{schedule.remaining_estimate(schedule.now())}; pass --now to run it now"
        )
        return 0
    params = {"levels": args.level, "max_new_tokens": args.max_new_tokens}
    return _submit(args, settings, "golden_check", params)


def trust_fit(args: argparse.Namespace, settings: Settings) -> int:
    level = args.level or settings.engine.default_level
    params = {"n": args.n, "level": level, "if_missing": args.if_missing}
    return _submit(args, settings, "trust_fit", {**params, "mode": settings.gateway.mode})


def measure_baseline(args: argparse.Namespace, settings: Settings) -> int:
    return _submit(args, settings, "baseline", {})


def _submit(args: argparse.Namespace, settings: Settings, kind: str, params: dict[str, Any]) -> int:
    upgrade(settings.database_url)
    sessions = session_factory(make_engine(settings.database_url))
    params = {key: value for key, value in params.items() if value}
    if args.inline:
        return _inline(settings, sessions, kind, params)
    job_id = jobs.submit(sessions, make_celery(settings), kind, "operator", params)
    emit(f"job {job_id} queued ({kind}); follow it with `sparseguard jobs show {job_id}`")
    if not args.wait:
        return 0
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        with sessions() as session:
            job = session.get(JobRun, job_id)
            if job is not None and job.status in jobs.FINISHED:
                emit_json(describe(job))
                return 0 if job.status == "succeeded" else 1
        time.sleep(POLL_S)
    raise TimeoutError(
        f"job {job_id} did not finish within {args.timeout:g} s; is a worker running?"
    )


def _inline(settings: Settings, sessions: Any, kind: str, params: dict[str, Any]) -> int:
    """Run the job in this process, recorded like any other."""
    from services.workers.baseline_job import measure_baselines
    from services.workers.drift import golden_check
    from services.workers.recalibration import recalibrate
    from services.workers.trust_fit import fit_trust

    with sessions.begin() as session:
        job_id = jobs.create_job(session, kind, "operator", params).id
    job = jobs.claim(sessions, job_id)
    assert job is not None  # just created
    try:
        if kind == "recalibrate":
            result = recalibrate(settings, sessions, job)
        elif kind == "trust_fit":
            result = fit_trust(settings, job)
        elif kind == "baseline":
            result = measure_baselines(settings, sessions, job)
        else:
            result = golden_check(settings, sessions, make_celery(settings), job)
    except Exception as exc:
        jobs.fail(sessions, job_id, f"{type(exc).__name__}: {exc}")
        raise
    jobs.finish(sessions, job_id, result)
    emit_json({"job_id": job_id, **result})
    return 0


def describe(job: JobRun) -> dict[str, Any]:
    return jobs.JobView.model_validate(job).model_dump(mode="json")


def list_jobs(args: argparse.Namespace, settings: Settings) -> int:
    upgrade(settings.database_url)
    with session_factory(make_engine(settings.database_url))() as session:
        found = jobs.recent_jobs(session, args.limit)
        if not found:
            emit("no jobs yet; try `sparseguard jobs golden-check --now`")
        for job in found:
            emit(
                f"{job.id:6}  {job.kind:13} {job.status:10} {job.reason:24} "
                f"{job.created_at:%Y-%m-%d %H:%M:%S}  {job.result or ''}"
            )
    return 0


def show_job(args: argparse.Namespace, settings: Settings) -> int:
    with session_factory(make_engine(settings.database_url))() as session:
        job = session.get(JobRun, args.job_id)
        if job is None:
            raise LookupError(f"no job {args.job_id}; see `sparseguard jobs list`")
        emit_json(describe(job))
    return 0


def show_flags(args: argparse.Namespace, settings: Settings) -> int:
    upgrade(settings.database_url)
    with session_factory(make_engine(settings.database_url))() as session:
        found = flags(session)
        if not found:
            emit("no flags raised")
        for flag in found:
            emit(
                f"{flag.model_id}  {flag.flag}  since {flag.set_at:%Y-%m-%d %H:%M}  "
                f"{flag.reason}  {flag.details}"
            )
    return 0
