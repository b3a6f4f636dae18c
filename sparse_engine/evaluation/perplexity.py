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
    documents: tuple[int, ...] = ()  # scored tokens per document, where documents are known

    def change_pct(self, dense: PerplexityResult, z: float = 0.0) -> float:
        """Perplexity increase over `dense` in percent; with z > 0, the upper bound of its
        one-sided interval at the normal level of z, from the paired per-token NLL
        differences. Where documents are known the error is taken over them (tokens of one
        document are not independent, documents are) and the bound is Student's t with one
        degree fewer than documents: with few documents the error is itself uncertain."""
        diff = self.token_nll - dense.token_nll
        se = _standard_error(diff, self.documents)
        if len(self.documents) > 1:
            z = t_quantile(z, len(self.documents) - 1)
        return 100.0 * (math.exp(float(diff.mean()) + z * se) - 1.0)

    def subset(self, keep: Sequence[bool]) -> PerplexityResult:
        """The result over the documents marked in `keep` (one flag per document)."""
        pieces = torch.split(self.token_nll, list(self.documents))
        nll = torch.cat([p for p, k in zip(pieces, keep, strict=True) if k])
        docs = tuple(n for n, k in zip(self.documents, keep, strict=True) if k)
        return PerplexityResult(math.exp(float(nll.mean())), self.sparsity, nll.numel(), nll, docs)


def t_quantile(z: float, df: int) -> float:
    """Student's t quantile with `df` degrees of freedom at the level of the normal quantile
    z (Cornish-Fisher expansion, Abramowitz and Stegun 26.7.5: 5 % low at df = 1, within
    0.3 % from df = 2)."""
    z3, z5, z7, z9 = z**3, z**5, z**7, z**9
    return (
        z
        + (z3 + z) / (4 * df)
        + (5 * z5 + 16 * z3 + 3 * z) / (96 * df**2)
        + (3 * z7 + 19 * z5 + 17 * z3 - 15 * z) / (384 * df**3)
        + (79 * z9 + 776 * z7 + 1482 * z5 - 1920 * z3 - 945 * z) / (92160 * df**4)
    )


def _standard_error(diff: torch.Tensor, documents: tuple[int, ...]) -> float:
    """Standard error of the mean of `diff`; over documents (cluster-robust) when there are
    two or more, else over tokens."""
    n = diff.numel()
    if len(documents) > 1:
        sums = torch.stack([d.sum() for d in torch.split(diff - diff.mean(), list(documents))])
        g = len(documents)
        return math.sqrt(g / (g - 1) * float((sums**2).sum())) / n
    return float(diff.std()) / math.sqrt(n) if n > 1 else 0.0


def perplexity(
    model: nn.Module,
    layers: list[LayerParts],
    token_ids: torch.Tensor,
    plan: SparsityPlan,
    chunk: int = 512,
    prefix: Sequence[int] = (),
    documents: Sequence[int] = (),
) -> PerplexityResult:
    """exp(mean next-token NLL) over `token_ids` (1-D), scored in independent chunks, each
    after `prefix` (the model's <bos>, where it has one), which is not scored. `documents`
    (their lengths, summing to the tokens) make the standard error one over documents."""
    head = torch.tensor(list(prefix), dtype=token_ids.dtype).unsqueeze(0)
    if token_ids.numel() < 2:
        raise ValueError("held-out text is too short to measure perplexity (need >= 2 tokens)")
    if documents and sum(documents) != token_ids.numel():
        raise ValueError(f"documents hold {sum(documents)} tokens, the text {token_ids.numel()}")
    recorder = SignalRecorder(len(layers))
    losses: list[torch.Tensor] = []
    with torch.inference_mode(), sparsified(layers, plan, recorder):
        for start in range(0, token_ids.numel() - 1, chunk):
            ids = token_ids[start : start + chunk + 1].unsqueeze(0)
            logits = model(input_ids=torch.cat([head, ids[:, :-1]], dim=1)).logits
            scored = logits[0, head.shape[1] :].float()
            losses.append(F.cross_entropy(scored, ids[0, 1:], reduction="none"))
    token_nll = torch.cat(losses).double()
    summary = recorder.summary()
    ppl = math.exp(float(token_nll.mean()))
    groups = tuple(n for n in (documents[0] - 1, *documents[1:]) if n) if documents else ()
    return PerplexityResult(ppl, summary.sparsity_ratio, token_nll.numel(), token_nll, groups)
