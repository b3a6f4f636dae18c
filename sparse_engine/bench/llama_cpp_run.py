"""Decode tokens/s of llama.cpp (llama-cpp-python) on a GGUF, run as its own process by
`sparse_engine.bench.speed` so that a crash in the native library cannot take the benchmark down.
Prints one JSON object: {"tokens_per_s": float}."""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def measure(gguf: str, prompt: str, new_tokens: int, threads: int) -> float:
    """Greedy decode of `new_tokens` (the end-of-sequence token does not stop it, as in the
    engine's benchmark) minus a run of one token, both after a warm-up."""
    from llama_cpp import Llama

    llm: Any = Llama(model_path=gguf, n_ctx=1024, n_threads=threads, verbose=False)
    ids = llm.tokenize(prompt.encode())

    def run(tokens: int) -> float:
        llm.reset()
        started = time.perf_counter()
        for produced, _ in enumerate(llm.generate(ids, temp=0.0), start=1):
            if produced >= tokens:
                break
        return time.perf_counter() - started

    run(4)
    one = run(1)
    return (new_tokens - 1) / max(run(new_tokens) - one, 1e-9)


if __name__ == "__main__":
    gguf, prompt, tokens, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    sys.stdout.write(json.dumps({"tokens_per_s": measure(gguf, prompt, tokens, threads)}) + "\n")
