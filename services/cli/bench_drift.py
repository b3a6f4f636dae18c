"""The KL-drift pass's cost in `sparseguard bench engine`: the dense teacher-forced pass over
16 answers batched (as the scheduler batches those that finish together) and over one, with
the head run on the answer spans only (`runtime.heads`, as served) against logits at every
position (how it ran before), and the bytes of logits each holds."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from sparse_engine.runtime.engine import Engine
from sparse_engine.runtime.heads import span_logits
from sparse_engine.sparsity.masking import masked

BATCH = 16


def drift_pass_cost(eng: Engine, prompt: str, answer: list[int], repeats: int) -> dict[str, Any]:
    """Median wall time (ms) of the dense pass for `BATCH` answers and for one, both ways.
    Prompts differ in length (the last k words dropped from the k-th) so rows are padded."""
    words = prompt.split()
    prompts = [
        eng.encode_messages([{"role": "user", "content": " ".join(words[: len(words) - k])}])
        for k in range(BATCH)
    ]
    out: dict[str, Any] = {"answer_tokens": len(answer)}
    for rows in (BATCH, 1):
        ids, mask, spans = _padded(prompts[:rows], answer)
        for name, run in (("span", _spans), ("every_position", _every_position)):
            times = []
            for _ in range(repeats + 1):  # the first warms up
                started = time.perf_counter()
                with torch.inference_mode(), masked(eng.lm.layers, eng.mask):
                    run(eng.lm.model, ids, mask, spans)
                times.append(time.perf_counter() - started)
            out[f"batch_{rows}_{name}_ms"] = round(1000 * statistics.median(times[1:]), 1)
        vocab = eng.vocab_size
        out[f"batch_{rows}_logits_mib"] = {
            "span": round(sum(e - s for s, e in spans) * vocab * 4 / 2**20, 1),
            "every_position": round(ids.numel() * vocab * 4 / 2**20, 1),
        }
    return out


def _padded(
    prompts: list[list[int]], answer: list[int]
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    rows = [p + answer[:-1] for p in prompts]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return ids, mask, [(len(p) - 1, len(p) - 1 + len(answer)) for p in prompts]


def _spans(model: Any, ids: torch.Tensor, mask: torch.Tensor, spans: list[tuple[int, int]]) -> Any:
    return span_logits(model, ids, mask, spans)


def _every_position(
    model: Any, ids: torch.Tensor, mask: torch.Tensor, spans: list[tuple[int, int]]
) -> Any:
    logits = model(input_ids=ids, attention_mask=mask).logits
    return [logits[b, s:e] for b, (s, e) in enumerate(spans)]
