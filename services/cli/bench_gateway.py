"""`sparseguard bench gateway`: the gateway's added latency and its throughput under
concurrent clients, on loopback, against the real engine."""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import statistics
import time
from typing import Any

import httpx

from services.cli.common import emit, emit_json
from services.config import Settings, TelemetrySettings
from services.gateway.app import create_app
from services.shared.engine import build_engine
from services.shared.serving import serve
from sparse_engine.runtime.engine import Engine, GenerationRequest
from sparse_engine.sparsity.plan import Level

MESSAGES = [{"role": "user", "content": "Name three primary colours."}]


def register(bench: Any) -> None:
    g = bench.add_parser("gateway", help="gateway added latency and requests/s under concurrency")
    g.add_argument("--requests", type=int, default=20, help="requests per measurement")
    g.add_argument("--max-tokens", type=int, default=8)
    g.add_argument("--level", default="balanced")
    g.add_argument("--json", action="store_true")
    g.set_defaults(handler=run_gateway_bench)


def run_gateway_bench(args: argparse.Namespace, settings: Settings) -> int:
    level = Level.parse(args.level)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    engine = build_engine(settings, prefix_cache=True)
    direct = [_direct(engine, level, args.max_tokens) for _ in range(args.requests)]
    # Telemetry off: this measures the HTTP path; the producer is asynchronous by design.
    quiet = settings.model_copy(update={"telemetry": TelemetrySettings(enabled=False)})
    with serve(create_app(quiet, engine=engine)) as url:
        body = {
            "messages": MESSAGES,
            "max_tokens": args.max_tokens,
            "ir_sparse_level": level.value,
            "temperature": 1.0,
        }
        via = [_post(url, body)[1] for _ in range(args.requests)]
        loads = {n: _load(url, body, n, max(args.requests, n * 2)) for n in (1, 4, 16)}
    report: dict[str, Any] = {
        "direct_ms": _percentiles(direct),
        "gateway_ms": _percentiles(via),
        "added_ms": {
            k: round(_percentiles(via)[k] - _percentiles(direct)[k], 1) for k in ("p50", "p99")
        },
        "load": loads,
    }
    if args.json:
        emit_json(report)
        return 0
    emit(f"gateway bench: {level.value}, {args.max_tokens} new tokens, {args.requests} requests")
    rows = {"engine direct": report["direct_ms"], "via gateway": report["gateway_ms"]}
    rows["added latency"] = report["added_ms"]
    for label, row in rows.items():
        emit(f"{label:15} p50 {row['p50']:8.1f} ms  p99 {row['p99']:8.1f} ms")
    for n, load in loads.items():
        rate, ok, errors = load["requests_per_s"], load["ok"], load["errors"]
        emit(f"{n:>2} clients: {rate:.2f} req/s, {ok} ok, {errors} errors {load['statuses']}")
    return 0


def _direct(engine: Engine, level: Level, max_tokens: int) -> float:
    started = time.perf_counter()
    request = GenerationRequest(messages=MESSAGES, max_new_tokens=max_tokens, temperature=1.0)
    engine.generate(request, level).result()
    return (time.perf_counter() - started) * 1000


def _post(url: str, body: dict[str, Any]) -> tuple[int, float]:
    started = time.perf_counter()
    try:
        status = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).status_code
    except httpx.HTTPError:
        status = 0
    return status, (time.perf_counter() - started) * 1000


def _load(url: str, body: dict[str, Any], clients: int, total: int) -> dict[str, Any]:
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda _: _post(url, body), range(total)))
    elapsed = time.perf_counter() - started
    statuses: dict[int, int] = {}
    for status, _ in results:
        statuses[status] = statuses.get(status, 0) + 1
    ok = statuses.get(200, 0)
    return {
        "requests_per_s": round(ok / elapsed, 2),
        "ok": ok,
        "errors": total - ok,
        "statuses": statuses,
    }


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"p50": round(statistics.median(ordered), 1), "p99": round(p99, 1)}
