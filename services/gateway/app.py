"""The gateway application: `create_app(settings)` builds it; the lifespan loads the engine
(unless one is given), starts the worker, telemetry and the control listener (new calibrations
and trust models without a restart), and closes them on shutdown."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from prometheus_client import CollectorRegistry

from services.config import Settings
from services.gateway.engine_thread import EngineWorker
from services.gateway.errors import ApiError, install_error_handlers, is_anthropic
from services.gateway.events import record_rejected
from services.gateway.limits import BodySizeLimit
from services.gateway.metrics import GatewayMetrics
from services.gateway.routes.admin import router as admin_router
from services.gateway.routes.chat import router as chat_router
from services.gateway.routes.status import router as status_router
from services.gateway.routes.system import router as system_router
from services.gateway.runtime import Runtime, TelemetrySink
from services.gateway.tracing import Tracing
from services.shared.engine import build_engine
from sparse_engine.runtime.engine import Engine

log = logging.getLogger(__name__)


def create_app(
    settings: Settings,
    *,
    engine: Engine | None = None,
    sink: TelemetrySink | None = None,
    upstream: httpx.AsyncClient | None = None,
    registry: CollectorRegistry | None = None,
) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            app.state.runtime = await _start(settings, stack, engine, sink, upstream, registry)
            log.info("gateway ready (%s mode)", settings.gateway.mode)
            yield
            app.state.runtime = None

    app = FastAPI(title="SparseGuard gateway", version="1", lifespan=lifespan)
    app.add_middleware(BodySizeLimit, max_bytes=settings.gateway.max_body_bytes)
    install_error_handlers(app, _on_reject)
    app.include_router(chat_router)
    app.include_router(system_router)
    app.include_router(admin_router)
    app.include_router(status_router)
    return app


def _on_reject(request: Request, error: ApiError) -> None:
    runtime: Runtime | None = getattr(request.app.state, "runtime", None)
    if runtime is not None:
        api = "anthropic" if is_anthropic(request.url.path) else "openai"
        record_rejected(runtime, api, error)


async def _start(
    settings: Settings,
    stack: AsyncExitStack,
    engine: Engine | None,
    sink: TelemetrySink | None,
    upstream: httpx.AsyncClient | None,
    registry: CollectorRegistry | None,
) -> Runtime:
    worker = EngineWorker(settings.gateway.queue_size, settings.engine)
    stack.callback(worker.close)
    if engine is None:  # loaded on the thread that runs it (engine_thread: 1.7x faster)
        build = worker.call(lambda: build_engine(settings, prefix_cache=True))
        engine = await asyncio.wrap_future(build)
    await worker.attach(engine)
    if sink is None and settings.telemetry.enabled:
        from services.telemetry.producer import TelemetryProducer

        producer = TelemetryProducer(settings.telemetry, settings.spool_dir)
        stack.callback(producer.close)
        sink = producer
    if upstream is None and settings.gateway.mode == "proxy":
        upstream = await stack.enter_async_context(httpx.AsyncClient())
    registry = registry or CollectorRegistry()
    rt = Runtime(settings, engine, worker, GatewayMetrics(registry), registry, sink, upstream)
    if settings.otel.endpoint:
        rt.tracing = Tracing(settings.otel)
        stack.callback(rt.tracing.close)
    stack.callback(rt.jobs.close)
    stack.callback(rt.knowledge.close)
    if settings.telemetry.enabled:
        from services.gateway.control_listener import ControlListener

        reloads = rt.metrics.calibration_reloads
        rt.control = ControlListener(settings, engine, reloads, rt.install_trust_model)
        rt.control.start()
        stack.callback(rt.control.stop)
    # What start-up built lives as long as the gateway: left to the collector, every full
    # collection scanned its ~600k objects and held all threads for 300-400 ms (measured
    # with `sparseguard bench gateway` on SmolLM2). Frozen, collections scan only what
    # requests allocate; thawed on shutdown, so a stopped gateway can still be collected.
    gc.collect()
    gc.freeze()
    stack.callback(gc.unfreeze)
    return rt
