"""`sparseguard bench gateway`: the gateway's added latency and its throughput under
concurrent clients, on loopback, against the real engine."""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import httpx

from services.cli.bench_load import kv_budget_mb, peak_rss_mb, percentile, print_loads, run_loads
from services.cli.common import emit, emit_json
from services.config import Settings, TelemetrySettings
from services.gateway.app import create_app
from services.gateway.events import record
from services.gateway.formats import Choice, openai_body
from services.gateway.inputs import from_openai
from services.gateway.intake import prepare
from services.gateway.pipeline import Final
from services.gateway.respond import token_text
from services.gateway.runtime import Runtime
from services.gateway.schemas import ChatCompletionRequest
from services.shared.serving import serve
from sparse_engine.runtime.engine import Engine, GenerationRequest, GenerationStats
from sparse_engine.sparsity.plan import Level

MESSAGES = [{"role": "user", "content": "Name three primary colours."}]
WARM_UP = 2


def register(bench: Any) -> None:
    g = bench.add_parser("gateway", help="gateway added latency and requests/s under concurrency")
    g.add_argument("--requests", type=int, default=20, help="requests per measurement")
    g.add_argument("--max-tokens", type=int, default=8)
    g.add_argument("--level", default="balanced")
    g.add_argument(
        "--clients", default="1,4,16,32", help="concurrent clients of the load runs (comma list)"
    )
    g.add_argument("--load-tokens", type=int, default=64, help="answer length in the load runs")
    g.add_argument(
        "--load-requests", type=int, default=0, help="requests per load run (0: 2 per client, 16+)"
    )
    g.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="load runs per client count, interleaved; each count reports its median round",
    )
    g.add_argument("--json", action="store_true")
    g.set_defaults(handler=run_gateway_bench)


def run_gateway_bench(args: argparse.Namespace, settings: Settings) -> int:
    """Like for like: greedy decoding (the same tokens both ways), the request the gateway
    makes (the trust readout on), drift sampling off and its dense pass timed apart. "Engine
    direct" runs on the gateway's own engine, on its engine thread, between the requests (a
    second copy of the model on another thread would compete with it for the cores)."""
    level = Level.parse(args.level)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    request = GenerationRequest(
        messages=MESSAGES, max_new_tokens=args.max_tokens, temperature=0.0, readout=True
    )
    # Telemetry off: this measures the HTTP path; the producer is asynchronous by design.
    clients = sorted({int(n) for n in args.clients.split(",") if n.strip()})
    # As many running sequences as clients, as llama.cpp's server gets parallel slots.
    engine_cfg = {"drift_sample_rate": 0.0, "max_batch": max(clients)}
    quiet = settings.model_copy(
        update={
            "telemetry": TelemetrySettings(enabled=False),
            "engine": settings.engine.model_copy(update=engine_cfg),
            "gateway": settings.gateway.model_copy(
                update={"queue_size": max(settings.gateway.queue_size, max(clients))}
            ),
        }
    )
    app = create_app(quiet)  # loads its engine on its engine thread, as served
    # One client with keep-alive, as SDKs use: a new httpx client per request costs ~20 ms
    # (its TLS context), which is the client's and not the gateway's.
    limits = httpx.Limits(max_connections=32)
    with serve(app) as url, httpx.Client(limits=limits) as client:
        rt: Runtime = app.state.runtime
        body = {
            "messages": MESSAGES,
            "max_tokens": args.max_tokens,
            "ir_sparse_level": level.value,
            "temperature": 0,
        }
        for _ in range(WARM_UP):
            _post(client, url, body)
        direct, via, inside, again = [], [], [], []
        for _ in range(args.requests):  # interleaved: all see the same machine state
            direct.append(rt.worker.call(lambda: _timed(rt.engine, request, level)).result())
            _, ms, engine_ms = _post(client, url, body)
            via.append(ms)
            inside.append(engine_ms)
            again.append(rt.worker.call(lambda: _timed(rt.engine, request, level)).result())
        with_drift = replace(request, measure_drift=True)
        drift = [
            rt.worker.call(lambda: _timed(rt.engine, with_drift, level)).result() for _ in range(5)
        ]
        stats = rt.worker.call(lambda: _generated(rt.engine, request, level)).result()
        stages = _stages(rt, client, url, body, stats)
        rss_before = peak_rss_mb()
        if args.rounds < 1:
            raise ValueError("--rounds must be at least 1")
        loads = run_loads(
            rt, level, clients, args.load_tokens, args.load_requests, settings, args.rounds
        )
    report: dict[str, Any] = {
        "direct_ms": _percentiles(direct),
        "gateway_ms": _percentiles(via),
        # Per pair (each request against the direct run just before it), then percentiles.
        "added_ms": _percentiles([v - d for v, d in zip(via, direct, strict=True)]),
        # The control: what pairing alone gives, a direct run against the one before it.
        "direct_vs_direct_ms": _percentiles([a - d for a, d in zip(again, direct, strict=True)]),
        # The same request's own engine time (its Server-Timing): no second run's noise.
        "gateway_engine_ms": _percentiles(inside),
        "outside_engine_ms": _percentiles([v - e for v, e in zip(via, inside, strict=True)]),
        "drift_pass_ms": round(statistics.median(drift) - statistics.median(direct), 1),
        "stages_ms": stages,
        "load": loads,
        "peak_rss_mb": {
            "bench_before_load": rss_before,
            "bench_after_load": peak_rss_mb(),
            "gateway_process": loads.pop("gateway_peak_rss_mb", None),
        },
        "kv_budget_mb": kv_budget_mb(rt),
    }
    if args.json:
        emit_json(report)
        return 0
    emit(f"gateway bench: {level.value}, {args.max_tokens} new tokens, {args.requests} requests")
    rows = {
        "engine direct": report["direct_ms"],
        "via gateway": report["gateway_ms"],
        "  of it in the engine (Server-Timing)": report["gateway_engine_ms"],
        "added: against the direct run before": report["added_ms"],
        "  control: a direct run against the one before": report["direct_vs_direct_ms"],
        "added: outside the engine, same request": report["outside_engine_ms"],
    }
    for label, row in rows.items():
        emit(f"{label:47} p50 {row['p50']:8.1f} ms  p99 {row['p99']:8.1f} ms")
    emit(f"drift sample's dense pass (apart): {report['drift_pass_ms']} ms")
    emit("stages of the added latency, each timed alone (median ms):")
    for name, ms in stages.items():
        emit(f"  {name:32} {ms:8.2f}")
    print_loads(loads)
    rss = report["peak_rss_mb"]
    emit(
        f"peak RSS: the gateway process under load {rss['gateway_process']:.0f} MB; this "
        f"process (its own gateway and engine) {rss['bench_before_load']:.0f} MB before the "
        f"engine-alone runs, {rss['bench_after_load']:.0f} MB after; KV budget "
        f"{report['kv_budget_mb']:.0f} MB ({rt.settings.engine.kv_tokens} tokens)"
    )
    return 0


def _timed(engine: Engine, request: GenerationRequest, level: Level) -> float:
    started = time.perf_counter()
    engine.generate(request, level).result()
    return (time.perf_counter() - started) * 1000


def _generated(engine: Engine, request: GenerationRequest, level: Level) -> GenerationStats:
    generation = engine.generate(request, level)
    "".join(generation)
    return generation.result()


def _stages(
    rt: Runtime, client: httpx.Client, url: str, body: dict[str, Any], stats: GenerationStats
) -> dict[str, float]:
    """The gateway's own steps on this request, each repeated and timed alone."""
    chat = from_openai(ChatCompletionRequest.model_validate(body))
    p = prepare(rt, chat)
    final = Final(stats, rt.trust.assess(stats, MESSAGES[0]["content"], False), 0.0)
    steps: dict[str, Callable[[], object]] = {
        "HTTP round trip (GET /healthz)": lambda: client.get(f"{url}/healthz"),
        "validate + convert the body": lambda: from_openai(
            ChatCompletionRequest.model_validate(body)
        ),
        "hygiene + policy + plan (prepare)": lambda: prepare(rt, chat),
        "trust assessment": lambda: rt.trust.assess(stats, MESSAGES[0]["content"], False),
        "telemetry event + metrics (record)": lambda: record(rt, p, final),
        "response body": lambda: openai_body(
            [Choice(p, final, stats.text)], rt.engine.lm.model_id, token_text(rt)
        ),
    }
    timings = {}
    for name, step in steps.items():
        runs = []
        for _ in range(20):
            started = time.perf_counter()
            step()
            runs.append((time.perf_counter() - started) * 1000)
        timings[name] = round(statistics.median(runs), 2)
    return timings


def _post(client: httpx.Client, url: str, body: dict[str, Any]) -> tuple[int, float, float]:
    """Status, ms at the client, and ms in the engine (the response's Server-Timing)."""
    started = time.perf_counter()
    try:
        response = client.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    except httpx.HTTPError:
        return 0, (time.perf_counter() - started) * 1000, float("nan")
    ms = (time.perf_counter() - started) * 1000
    timing = response.headers.get("server-timing", "")
    parts = dict(part.strip().split(";dur=") for part in timing.split(",") if ";dur=" in part)
    return response.status_code, ms, float(parts.get("engine", "nan"))


def _percentiles(values: list[float]) -> dict[str, float]:
    return {"p50": round(percentile(values, 0.5), 1), "p99": round(percentile(values, 0.99), 1)}
