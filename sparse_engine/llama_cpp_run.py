"""Decode tokens/s of llama.cpp (llama-cpp-python) on a GGUF, run as its own process by
`sparse_engine.speed` so that a crash in the native library cannot take the benchmark down.
Prints one JSON object: {"tokens_per_s": float}."""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def measure(gguf: str, prompt: str, new_tokens: int, threads: int) -> float:
    """A run of `new_tokens` minus a run of one token, both after a warm-up."""
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_ctx=1024, n_threads=threads, verbose=False)

    def run(tokens: int) -> tuple[float, int]:
        started = time.perf_counter()
        out: Any = llm(prompt, max_tokens=tokens, temperature=0.0)
        return time.perf_counter() - started, int(out["usage"]["completion_tokens"])

    run(4)
    one, _ = run(1)
    full, produced = run(new_tokens)
    return (produced - 1) / max(full - one, 1e-9)


if __name__ == "__main__":
    gguf, prompt, tokens, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    sys.stdout.write(json.dumps({"tokens_per_s": measure(gguf, prompt, tokens, threads)}) + "\n")
