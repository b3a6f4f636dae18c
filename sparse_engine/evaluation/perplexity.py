"""Perplexity of held-out text, under any sparsity plan, with realised sparsity measured."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sparse_engine.model.arch import LayerParts
from sparse_engine.sparsity.hooks import sparsified
from sparse_engine.sparsity.plan import SparsityPlan
from sparse_engine.sparsity.recorder import SignalRecorder


@dataclass(frozen=True, slots=True)
class PerplexityResult:
    perplexity: float
    sparsity: float
    num_tokens: int
    token_nll: torch.Tensor  # per scored token, float64, for paired comparisons

    def change_pct(self, dense: PerplexityResult, z: float = 0.0) -> float:
        """Perplexity increase over `dense` in percent; with z > 0, the upper bound of its
        z-standard-error interval from the paired per-token NLL differences."""
        diff = self.token_nll - dense.token_nll
        margin = z * float(diff.std()) / math.sqrt(diff.numel()) if diff.numel() > 1 else 0.0
        return 100.0 * (math.exp(float(diff.mean()) + margin) - 1.0)


def perplexity(
    model: nn.Module,
    layers: list[LayerParts],
    token_ids: torch.Tensor,
    plan: SparsityPlan,
    chunk: int = 512,
    prefix: Sequence[int] = (),
) -> PerplexityResult:
    """exp(mean next-token NLL) over `token_ids` (1-D), scored in independent chunks, each
    after `prefix` (the model's <bos>, where it has one), which is not scored."""
    head = torch.tensor(list(prefix), dtype=token_ids.dtype).unsqueeze(0)
    if token_ids.numel() < 2:
        raise ValueError("held-out text is too short to measure perplexity (need >= 2 tokens)")
    recorder = SignalRecorder(len(layers))
    losses: list[torch.Tensor] = []
    with torch.inference_mode(), sparsified(layers, plan, recorder):
        for start in range(0, token_ids.numel() - 1, chunk):
            ids = token_ids[start : start + chunk + 1].unsqueeze(0)
            if ids.shape[1] < 2:
                break
            logits = model(input_ids=torch.cat([head, ids[:, :-1]], dim=1)).logits
            scored = logits[0, head.shape[1] :].float()
            losses.append(F.cross_entropy(scored, ids[0, 1:], reduction="none"))
    token_nll = torch.cat(losses).double()
    summary = recorder.summary()
    ppl = math.exp(float(token_nll.mean()))
    return PerplexityResult(ppl, summary.sparsity_ratio, token_nll.numel(), token_nll)
