"""Decode speed at batch 1 against the memory-bandwidth ceiling: tokens/s, the weight bytes one
token reads, and the share of the ceiling (measured bandwidth / bytes per token) reached."""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sparse_engine.runtime.engine import Engine
from sparse_engine.runtime.fastpath import FastDecoder
from sparse_engine.runtime.generation import GenerationRequest, Message
from sparse_engine.sparsity.plan import Level, SparsityPlan

GB = 1e9


@dataclass(frozen=True, slots=True)
class SpeedRow:
    path: str  # reference | pytorch (the fast path's fallback) | fast | llama.cpp
    level: str
    tokens_per_s: float
    bytes_per_token: float
    bandwidth_bytes_per_s: float
    weights: str = "float32"
    perplexity: float | None = None  # teacher-forced on held-out text, where measured

    @property
    def ceiling_tokens_per_s(self) -> float:
        return self.bandwidth_bytes_per_s / self.bytes_per_token

    @property
    def ceiling_share(self) -> float:
        return self.tokens_per_s / self.ceiling_tokens_per_s


def reference_bytes(model: Any) -> float:
    """Weights a Hugging Face decode step reads: every parameter but the embedding lookup's
    (the tied head is read whole)."""
    embed = model.get_input_embeddings().weight
    tied = embed.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return float(total if tied else total - embed.numel() * embed.element_size())


def stream_bandwidth(native: Any = None, megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes/s a float32 matrix-vector product streams here (the shape of a decode step): the
    best of PyTorch's and, when given, the compiled kernel's."""
    cols = 4096
    weights = torch.randn(megabytes * 2**20 // (4 * cols), cols)
    x = torch.randn(cols)
    rows = weights.T.contiguous()  # input-major, as the kernel reads it: the same product
    products: list[Callable[[], object]] = [lambda: weights @ x]
    if native is not None:
        products.append(lambda: native.rows_matvec(x, rows, None, -1.0))
    best = float("inf")
    for product in products:
        for _ in range(repeats):
            started = time.perf_counter()
            product()
            best = min(best, time.perf_counter() - started)
    return weights.numel() * 4 / best


def goals(rows: list[SpeedRow]) -> list[tuple[str, bool]]:
    """The issue's goals, judged on the measured rows: (what was compared, met)."""
    found = {(r.path, r.level, r.weights): r.tokens_per_s for r in rows}
    out = []
    reference = found.get(("reference", "dense", "float32"))
    dense = found.get(("fast", "dense", "float32"))
    if reference and dense:
        out.append(
            (f"fast dense / reference: {dense / reference:.2f}x (goal 2x)", dense >= 2 * reference)
        )
    for weights in sorted({r.weights for r in rows if r.path == "fast"}):
        base = found.get(("fast", "dense", weights))
        balanced = found.get(("fast", "balanced", weights))
        if base and balanced:
            ratio = balanced / base
            out.append((f"{weights} balanced / fast dense: {ratio:.2f}x (goal 1.3x)", ratio >= 1.3))
    low = [f"{r.path} {r.level} {r.weights}" for r in rows if r.ceiling_share < 0.6]
    out.append((f"rows under 60% of their ceiling: {', '.join(low) or 'none'}", not low))
    cpp = found.get(("llama.cpp", "dense", "Q4_1"))
    best = max(
        (tps for (path, level, _), tps in found.items() if path == "fast" and level == "balanced"),
        default=None,
    )
    if cpp and best:
        out.append((f"best balanced {best:.1f} tok/s against llama.cpp {cpp:.1f}", best >= cpp))
    return out


def reference_speed(
    engine: Engine, messages: list[Message], level: Level, new_tokens: int, repeats: int
) -> float:
    """Median decode tokens/s of `Engine.generate` (Hugging Face forward per token)."""
    request = GenerationRequest(
        messages=messages, max_new_tokens=new_tokens, ignore_eos=True, use_prefix_cache=False
    )
    engine.generate(request, level).result()  # warm-up
    runs = [engine.generate(request, level).result().decode_tokens_per_s for _ in range(repeats)]
    return statistics.median(runs)


def fast_speed(
    decoder: FastDecoder, prompt_ids: list[int], engine: Engine, level: Level, new_tokens: int,
    repeats: int,
) -> tuple[float, float]:  # fmt: skip
    """Median decode tokens/s of the fast path (greedy) and the share of weights read."""
    plan = engine.plan(level)

    def once() -> float:
        decoder.reset()
        token = int(decoder.prefill(prompt_ids, plan).argmax())
        started = time.perf_counter()
        for _ in range(new_tokens - 1):
            token = int(decoder.step(token, plan).argmax())
        return (new_tokens - 1) / (time.perf_counter() - started)

    once()  # warm-up
    decoder.weights_read = decoder.weights_total = 0.0
    runs = [once() for _ in range(repeats)]
    return statistics.median(runs), decoder.read_share


def fast_perplexity(
    decoder: FastDecoder, ids: list[int], plan: SparsityPlan, prefix: Sequence[int] = ()
) -> float:
    """Perplexity of `ids` teacher-forced one decode step at a time, as decoding runs, after
    `prefix` (the model's <bos>, where it has one), as `evaluation.perplexity` scores."""
    decoder.reset()
    logits = decoder.prefill([*prefix, *ids[:1]], plan)
    nll = 0.0
    for token in ids[1:]:
        nll -= float(torch.log_softmax(logits.float(), -1)[token])
        logits = decoder.step(token, plan)
    return math.exp(nll / (len(ids) - 1))


def llama_cpp_speed(gguf: str, prompt: str, new_tokens: int, threads: int) -> float | str:
    """Decode tokens/s of llama.cpp on the same GGUF, measured in a child process, or why
    there is no figure (not installed: `make llama-cpp` builds it; or how it failed)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "not installed (`make llama-cpp` builds llama-cpp-python, about 10 minutes)"
    command = [sys.executable, "-m", "sparse_engine.bench.llama_cpp_run", gguf, prompt]
    try:
        done = subprocess.run(
            [*command, str(new_tokens), str(threads)], capture_output=True, text=True, timeout=600
        )
    except subprocess.TimeoutExpired:
        return "did not finish within 600 s"
    if done.returncode != 0:
        how = f"signal {-done.returncode}" if done.returncode < 0 else f"exit {done.returncode}"
        return f"crashed ({how}): {done.stderr.strip()[-200:] or 'no message'}"
    return float(json.loads(done.stdout)["tokens_per_s"])
