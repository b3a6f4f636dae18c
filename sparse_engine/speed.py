"""Decode speed at batch 1 against the memory-bandwidth ceiling: tokens/s, the weight bytes one
token reads, and the share of the ceiling (measured bandwidth / bytes per token) reached."""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from sparse_engine.engine import Engine
from sparse_engine.fastpath import FastDecoder
from sparse_engine.plan import Level
from sparse_engine.requests import GenerationRequest, Message

GB = 1e9


@dataclass(frozen=True, slots=True)
class SpeedRow:
    path: str  # reference | fast | llama.cpp
    level: str
    tokens_per_s: float
    bytes_per_token: float
    bandwidth_bytes_per_s: float

    @property
    def ceiling_tokens_per_s(self) -> float:
        return self.bandwidth_bytes_per_s / self.bytes_per_token

    @property
    def ceiling_share(self) -> float:
        return self.tokens_per_s / self.ceiling_tokens_per_s


def stream_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes/s a float32 matrix-vector product streams here: the shape of a decode step."""
    cols = 4096
    weights = torch.randn(megabytes * 2**20 // (4 * cols), cols)
    x = torch.randn(cols)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        weights @ x
        best = min(best, time.perf_counter() - started)
    return weights.numel() * 4 / best


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


def llama_cpp_speed(gguf: str, prompt: str, new_tokens: int, threads: int) -> float | str:
    """Decode tokens/s of llama.cpp on the same GGUF, measured in a child process, or why
    there is no figure (not installed: `make llama-cpp` builds it; or how it failed)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "not installed (`make llama-cpp` builds llama-cpp-python, about 10 minutes)"
    command = [sys.executable, "-m", "sparse_engine.llama_cpp_run", gguf, prompt]
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
