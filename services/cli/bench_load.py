"""The load half of `sparseguard bench gateway`: N concurrent clients, each sending real
prompts (ShareGPT first turns, the evaluation half of `sparse_engine.data.traffic`) one after
another with streaming on, against the gateway; the same prompts through the engine's
scheduler alone (no HTTP, no guardrail) at the same concurrency; and, where llama.cpp's server
is built (`make llama-server`), the same prompts against it on the same GGUF with as many
parallel slots as clients. Figures per run: generated tokens/s, requests/s, time to first
token and time per output token (p50/p99), request latency."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from services.cli.common import emit
from services.config import Settings
from services.gateway.runtime import Runtime
from services.shared.serving import free_port
from sparse_engine.data.traffic import healthy
from sparse_engine.model.catalog import gguf_file
from sparse_engine.runtime.generation import GenerationRequest, GenerationStats
from sparse_engine.runtime.scheduler import Scheduler
from sparse_engine.sparsity.plan import Level

log = logging.getLogger(__name__)
LLAMA_SERVER = Path.home() / ".cache" / "sparseguard" / "bin" / "llama-server"


@dataclass(frozen=True, slots=True)
class Sample:
    ok: bool
    ttft_s: float
    total_s: float
    tokens: int

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first."""
        return (self.total_s - self.ttft_s) / (self.tokens - 1) if self.tokens > 1 else None


@dataclass(frozen=True, slots=True)
class LoadRow:
    target: str
    clients: int
    requests: int
    errors: int
    tokens_per_s: float
    requests_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    latency_p50_ms: float
    latency_p99_ms: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarise(target: str, clients: int, samples: list[Sample], elapsed: float) -> LoadRow:
    ok = [s for s in samples if s.ok]
    tpot = [t for t in (s.tpot_s for s in ok) if t is not None]
    ms = 1000.0
    return LoadRow(
        target,
        clients,
        len(samples),
        len(samples) - len(ok),
        round(sum(s.tokens for s in ok) / elapsed, 1),
        round(len(ok) / elapsed, 2),
        round(percentile([s.ttft_s for s in ok], 0.5) * ms, 1),
        round(percentile([s.ttft_s for s in ok], 0.99) * ms, 1),
        round(percentile(tpot, 0.5) * ms, 1),
        round(percentile(tpot, 0.99) * ms, 1),
        round(percentile([s.total_s for s in ok], 0.5) * ms, 1),
        round(percentile([s.total_s for s in ok], 0.99) * ms, 1),
    )


def percentile(values: list[float], q: float) -> float:
    """The median at q=0.5, else the nearest-rank value (NaN without values)."""
    if not values:
        return float("nan")
    if q == 0.5:
        return statistics.median(values)
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_clients(
    send: Callable[[int], Sample], clients: int, total: int
) -> tuple[list[Sample], float]:
    """`total` requests (index i sends prompt i), `clients` in flight at any time."""
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        samples = list(pool.map(send, range(total)))
    return samples, time.perf_counter() - started


def stream_openai(
    client: httpx.Client,
    url: str,
    body: dict[str, Any],
    count_usage: bool = True,
    retry: bool = True,
) -> Sample:
    """One streamed chat completion: time to the first content and to the end, and the
    completion tokens from the usage chunk (or one per content chunk without one)."""
    started = time.perf_counter()
    first, tokens, chunks = 0.0, 0, 0
    streamed = {**body, "stream": True}
    if count_usage:
        streamed["stream_options"] = {"include_usage": True}
    try:
        with client.stream("POST", f"{url}/v1/chat/completions", json=streamed, timeout=600) as r:
            if r.status_code != 200:
                r.read()
                return Sample(False, 0.0, time.perf_counter() - started, 0)
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = int(chunk["usage"].get("completion_tokens") or 0)
                for choice in chunk.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        first = first or time.perf_counter() - started
                        chunks += 1
    except httpx.RemoteProtocolError as exc:
        if not first and retry:
            # a kept-alive connection the server had closed before this request reached it
            return stream_openai(client, url, body, count_usage, retry=False)
        log.warning("request failed: %s", exc)
        return Sample(False, 0.0, time.perf_counter() - started, 0)
    except httpx.HTTPError as exc:
        log.warning("request failed: %s", exc)
        return Sample(False, 0.0, time.perf_counter() - started, 0)
    total = time.perf_counter() - started
    return Sample(True, first or total, total, tokens or chunks)


class _Timing:
    """A scheduler sink that times one request from its submission."""

    def __init__(self) -> None:
        self.sent_at = time.perf_counter()
        self.first = 0.0
        self.stats: GenerationStats | None = None
        self.over = threading.Event()

    def started(self) -> None:
        pass

    def delta(self, text: str) -> None:
        self.first = self.first or time.perf_counter() - self.sent_at

    def done(self, stats: GenerationStats) -> None:
        self.stats = stats
        self.over.set()

    def error(self, exc: Exception) -> None:
        log.warning("engine request failed: %s", exc)
        self.over.set()


def engine_alone(scheduler: Scheduler, request: GenerationRequest, level: Level) -> Sample:
    """One request straight into the engine's scheduler (no HTTP, no guardrail)."""
    sink = _Timing()
    scheduler.submit(request, level, sink)
    sink.over.wait(600)
    total = time.perf_counter() - sink.sent_at
    if sink.stats is None:
        return Sample(False, 0.0, total, 0)
    return Sample(True, sink.first or total, total, sink.stats.completion_tokens)


def llama_server_binary() -> Path | None:
    configured = os.environ.get("SPARSEGUARD_LLAMA_SERVER")
    found = Path(configured) if configured else LLAMA_SERVER
    if found.is_file():
        return found
    on_path = shutil.which("llama-server")
    return Path(on_path) if on_path else None


@contextmanager
def llama_server(binary: Path, gguf: Path, slots: int, context: int) -> Iterator[str]:
    """llama.cpp's server on loopback: `slots` parallel sequences sharing `context` tokens."""
    port = free_port()
    command = [
        str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
        "-np", str(slots), "-c", str(context), "-t", str(os.cpu_count() or 1), "--no-webui",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(process, f"{url}/health", "llama-server")
        yield url
    finally:
        _stop(process)


def _wait_healthy(process: subprocess.Popen[bytes], url: str, name: str) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with status {process.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{name} did not become healthy within 180 s")


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()


def run_loads(
    rt: Runtime,
    level: Level,
    clients: list[int],
    tokens: int,
    requests: int,
    settings: Settings,
    rounds: int = 1,
) -> dict[str, Any]:
    """Each client count against the gateway (its own process, as deployed: a client in the
    same process would take the interpreter lock from its engine thread), the engine alone
    (the scheduler of `rt`, in this process) and llama.cpp's server. With `rounds` > 1 the
    gateway's and the engine's client counts run that many times, interleaved (1, 16, 1, 16,
    ...), so that a machine whose speed drifts weighs on every count alike: each count's row
    is its median round by tok/s, and `round_ratios` pairs each round with the first count's
    run of the same round."""
    count = max(requests, 2 * max(clients), 16)
    prompts = healthy("chat", settings.cache_home, "evaluation", count)

    def body(i: int) -> dict[str, Any]:
        return {
            "messages": prompts[i % len(prompts)].messages(),
            "max_tokens": tokens,
            "temperature": 0,
            "ir_sparse_level": level.value,  # llama.cpp's server ignores it
        }

    def request(i: int) -> GenerationRequest:
        messages = prompts[i % len(prompts)].messages()
        return GenerationRequest(
            messages=messages, max_new_tokens=tokens, temperature=0.0, readout=True
        )

    out: dict[str, Any] = {"gateway": [], "engine": [], "llama_server": []}
    sizes = [(n, requests or max(16, 2 * n)) for n in clients]
    limits = httpx.Limits(max_connections=max(clients) + 4)
    with httpx.Client(limits=limits) as client:
        with gateway_process(max(clients)) as (url, process):
            out["gateway"] = _rounds(
                "gateway", sizes, rounds, lambda i: stream_openai(client, url, body(i))
            )
            out["gateway_peak_rss_mb"] = peak_rss_of(process.pid)
        scheduler = rt.worker.scheduler
        out["engine"] = _rounds(
            "engine alone", sizes, rounds, lambda i: engine_alone(scheduler, request(i), level)
        )
        binary = llama_server_binary()
        if binary is None:
            out["llama_server"] = "absent: `make llama-server` builds it"
            return out
        gguf = gguf_file(settings.engine.model, settings.cache_home)
        for n, total in sizes:
            log.info("load: llama.cpp server, %d slots, %d requests", n, total)
            with llama_server(binary, gguf, n, n * 1024) as served:
                stream_openai(client, served, body(0))  # warm-up
                got = run_clients(lambda i: stream_openai(client, served, body(i)), n, total)
            out["llama_server"].append(summarise("llama.cpp server", n, *got).to_dict())
    return out


def _rounds(
    target: str, sizes: list[tuple[int, int]], rounds: int, send: Callable[[int], Sample]
) -> list[dict[str, Any]]:
    """Per client count, its median round's row (by tok/s), every round's tok/s and its ratio
    to the first count's in the same round."""
    runs: list[list[LoadRow]] = [[] for _ in sizes]
    for r in range(rounds):
        for k, (n, total) in enumerate(sizes):
            log.info("load: %s, %d clients, %d requests, round %d", target, n, total, r + 1)
            runs[k].append(summarise(target, n, *run_clients(send, n, total)))
    rows = []
    for found in runs:
        row = sorted(found, key=lambda run: run.tokens_per_s)[(len(found) - 1) // 2].to_dict()
        row["round_tokens_per_s"] = [run.tokens_per_s for run in found]
        row["round_ratios"] = [
            round(run.tokens_per_s / first.tokens_per_s, 2) if first.tokens_per_s else None
            for run, first in zip(found, runs[0], strict=True)
        ]
        rows.append(row)
    return rows


@contextmanager
def gateway_process(max_batch: int) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`sparseguard gateway` on a free loopback port, configured as the latency runs are
    (telemetry and drift sampling off) with `max_batch` running sequences."""
    port = free_port()
    env = os.environ | {
        "SPARSEGUARD_TELEMETRY__ENABLED": "false",
        "SPARSEGUARD_ENGINE__DRIFT_SAMPLE_RATE": "0",
        "SPARSEGUARD_ENGINE__MAX_BATCH": str(max_batch),
        "SPARSEGUARD_GATEWAY__QUEUE_SIZE": str(max(max_batch, 16)),
    }
    command = [sys.executable, "-c", "import sys; from services.cli import main; sys.exit(main())"]
    command += ["gateway", "--host", "127.0.0.1", "--port", str(port)]
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(process, f"{url}/healthz", "the gateway")
        yield url, process
    finally:
        _stop(process)


def peak_rss_of(pid: int) -> float:
    """A live process's peak resident set (VmHWM), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def print_loads(loads: dict[str, Any]) -> None:
    emit("load: streamed requests, real prompts (ShareGPT), each run's figures")
    emit(
        f"{'target':18} {'clients':>7} {'tok/s':>7} {'req/s':>6} {'ttft p50':>9} {'p99':>7} "
        f"{'tpot p50':>9} {'p99':>7} {'lat p50':>8} {'p99':>7} {'errors':>6}"
    )
    rows = [*loads["gateway"], *loads["engine"]]
    if isinstance(loads["llama_server"], list):
        rows += loads["llama_server"]
    for r in rows:
        emit(
            f"{r['target']:18} {r['clients']:>7} {r['tokens_per_s']:>7.1f} "
            f"{r['requests_per_s']:>6.2f} {r['ttft_p50_ms']:>9.0f} {r['ttft_p99_ms']:>7.0f} "
            f"{r['tpot_p50_ms']:>9.1f} {r['tpot_p99_ms']:>7.1f} {r['latency_p50_ms']:>8.0f} "
            f"{r['latency_p99_ms']:>7.0f} {r['errors']:>6}"
        )
    if isinstance(loads["llama_server"], str):
        emit(f"llama.cpp server: {loads['llama_server']}")
    for via, alone in zip(loads["gateway"], loads["engine"], strict=True):
        emit(
            f"{via['clients']:>2} clients: the guardrail adds "
            f"{via['latency_p50_ms'] - alone['latency_p50_ms']:.0f} ms at p50, "
            f"{via['latency_p99_ms'] - alone['latency_p99_ms']:.0f} ms at p99 of request latency"
        )
    one = loads["gateway"][0]
    for r in loads["gateway"][1:]:
        paired = [x for x in r.get("round_ratios", []) if x is not None]
        rounds = f" (per round: {', '.join(f'{x:.2f}x' for x in paired)})" if paired[1:] else ""
        emit(f"{r['clients']:>2} clients: {r['tokens_per_s'] / one['tokens_per_s']:.2f}x the "
             f"tok/s of {one['clients']}{rounds}")  # fmt: skip


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def kv_budget_mb(rt: Runtime) -> float:
    """What the configured token budget holds at float32 K and V over every layer."""
    cfg = rt.engine.lm.model.config
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    per_token = 2 * int(cfg.num_hidden_layers) * int(cfg.num_key_value_heads) * head_dim * 4
    return rt.settings.engine.kv_tokens * per_token / 2**20
