"""Perplexity of held-out text, under any sparsity plan, with realised sparsity measured."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sparse_engine.arch import LayerParts
from sparse_engine.hooks import sparsified
from sparse_engine.plan import SparsityPlan
from sparse_engine.recorder import SignalRecorder


@dataclass(frozen=True, slots=True)
class PerplexityResult:
    perplexity: float
    sparsity: float
    num_tokens: int


def perplexity(
    model: nn.Module,
    layers: list[LayerParts],
    token_ids: torch.Tensor,
    plan: SparsityPlan,
    chunk: int = 512,
) -> PerplexityResult:
    """exp(mean next-token NLL) over `token_ids` (1-D), scored in independent chunks."""
    if token_ids.numel() < 2:
        raise ValueError("held-out text is too short to measure perplexity (need >= 2 tokens)")
    recorder = SignalRecorder(len(layers))
    nll, count = 0.0, 0
    with torch.inference_mode(), sparsified(layers, plan, recorder):
        for start in range(0, token_ids.numel() - 1, chunk):
            ids = token_ids[start : start + chunk + 1].unsqueeze(0)
            if ids.shape[1] < 2:
                break
            logits = model(input_ids=ids[:, :-1]).logits
            nll += float(F.cross_entropy(logits[0].float(), ids[0, 1:], reduction="sum"))
            count += ids.shape[1] - 1
    summary = recorder.summary()
    return PerplexityResult(math.exp(nll / count), summary.sparsity_ratio, count)
