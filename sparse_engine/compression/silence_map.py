"""Confirming silent channels by ablation, and the whole silence-map pipeline:
capture -> rule -> zero the candidates with hooks -> accept if the metric moves < the budget.

Metrics: "perplexity" (held-out text, increase in percent) and "answers" (greedy continuations
of prompts cut from the held-out text; the drop in exact-match share, in percentage points).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from sparse_engine.calibration.pipeline import CalibrationData
from sparse_engine.compression.silence import (
    KIND_ROLES,
    Ablation,
    ChannelSet,
    ChannelSite,
    LayerMap,
    SilenceMap,
    SilenceRule,
    capture,
    flag_bias_like,
    flag_silent,
    protected_layers,
)
from sparse_engine.model.arch import LayerParts
from sparse_engine.model.loader import LoadedModel
from sparse_engine.sparsity.plan import SparsityPlan

log = logging.getLogger(__name__)
METRICS = ("perplexity", "answers")


@contextmanager
def channels_zeroed(
    layers: list[LayerParts], channels: dict[ChannelSite, list[int]]
) -> Iterator[None]:
    """Zero the listed input channels of each unit's projection for the duration of the block."""
    handles: list[RemovableHandle] = []
    try:
        for (layer, kind), index in channels.items():
            if index:
                module = layers[layer].get(KIND_ROLES[kind])
                handles.append(module.register_forward_pre_hook(_zero_hook(index)))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _zero_hook(index: list[int]) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]
        mask = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
        mask[index] = 0
        return (x * mask, *args[1:])

    return hook


def measure(lm: LoadedModel, data: CalibrationData, metric: str) -> Any:
    """The metric's raw observation under whatever hooks are active."""
    if metric == "perplexity":
        return data.heldout_perplexity(lm, SparsityPlan()).perplexity
    if metric == "answers":
        return greedy_answers(lm.model, answer_prompts(data.heldout))
    raise ValueError(f"unknown ablation metric '{metric}'; choose one of: {', '.join(METRICS)}")


def answer_prompts(heldout: torch.Tensor, num: int = 16, length: int = 48) -> list[torch.Tensor]:
    count = min(num, heldout.numel() // length)
    return [heldout[i * length : (i + 1) * length] for i in range(count)]


def greedy_answers(model: nn.Module, prompts: list[torch.Tensor], new: int = 24) -> list[Any]:
    """Greedy continuations, token by token without a cache: slow but free of any
    generation-config defaults, so dense and ablated runs differ only by the hooks."""
    answers = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = prompt.unsqueeze(0)
            for _ in range(new):
                next_id = model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
                ids = torch.cat([ids, next_id], dim=1)
            answers.append(ids[0, prompt.numel() :].tolist())
    return answers


def ablate(
    lm: LoadedModel, data: CalibrationData, candidates: dict[ChannelSite, list[int]], metric: str
) -> Ablation:
    dense = measure(lm, data, metric)
    with channels_zeroed(lm.layers, candidates):
        ablated = measure(lm, data, metric) if any(candidates.values()) else dense
    if metric == "answers":
        same = sum(a == b for a, b in zip(dense, ablated, strict=True))
        dense_score, score = 100.0, 100.0 * same / max(len(dense), 1)
        change = dense_score - score
    else:
        dense_score, score = float(dense), float(ablated)
        change = 100.0 * (score / dense_score - 1.0)
    return Ablation(metric, dense_score, score, change, False, _candidate_rows(candidates))


def _candidate_rows(candidates: dict[ChannelSite, list[int]]) -> list[dict[str, Any]]:
    rows: dict[int, dict[str, Any]] = {}
    for (layer, kind), index in sorted(candidates.items()):
        if index:
            rows.setdefault(layer, {"layer": layer, "mlp": [], "attn": []})[kind] = index
    return list(rows.values())


def build_map(
    lm: LoadedModel,
    data: CalibrationData,
    rule: SilenceRule,
    critical: dict[ChannelSite, list[int]] | None = None,
    metric: str = "perplexity",
    progress: Callable[[int], None] | None = None,
) -> tuple[SilenceMap, dict[ChannelSite, torch.Tensor]]:
    """The silence map of `lm` on `data`, and each unit's (samples, channels) mean |a|."""
    if metric not in METRICS:
        raise ValueError(f"unknown ablation metric '{metric}'; choose one of: {', '.join(METRICS)}")
    critical = critical or {}
    captured = capture(lm.model, lm.layers, data.batches, rule, progress)
    protected = protected_layers(lm.num_layers, rule)
    layers = []
    for part in lm.layers:
        sets = {}
        for kind in KIND_ROLES:
            stats = captured.units[(part.index, kind)]
            flagged = flag_silent(stats, rule, critical.get((part.index, kind), ()))
            sets[kind] = ChannelSet.from_stats(stats, flagged, flag_bias_like(stats, rule))
        layers.append(LayerMap(part.index, sets["mlp"], sets["attn"]))
    candidates = {
        (lm_.layer, kind): cs.flagged
        for lm_ in layers
        if lm_.layer not in protected
        for kind, cs in lm_.kinds().items()
    }
    ablation = ablate(lm, data, candidates, metric)
    ablation.accepted = ablation.change_pct < rule.max_change_pct
    if ablation.accepted:
        for (layer, kind), index in candidates.items():
            layers[layer].kinds()[kind].silent = list(index)
    log.info("ablation %s: %s", metric, ablation)
    return SilenceMap(
        model_id=lm.model_id,
        weights_sha256=lm.weights_sha256,
        corpus=data.name,
        samples=captured.samples,
        tokens=captured.tokens,
        rule=rule,
        protected_layers=protected,
        critical=[
            {"layer": u[0], "kind": u[1], "channel": c} for u, cs in critical.items() for c in cs
        ],
        layers=layers,
        ablation=ablation,
    ), captured.series_by_unit()


def read_critical(path: Path) -> dict[ChannelSite, list[int]]:
    """Critical channels from a text file: one `LAYER KIND CHANNEL` per line (KIND is mlp or
    attn), `#` starts a comment. Example: `12 mlp 431`."""
    found: dict[ChannelSite, list[int]] = {}
    for num, line in enumerate(path.read_text().splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) != 3 or words[1] not in KIND_ROLES or not _ints(words[0], words[2]):
            raise ValueError(
                f"{path}:{num}: expected 'LAYER KIND CHANNEL' with KIND mlp or attn, got {line!r}"
            )
        found.setdefault((int(words[0]), words[1]), []).append(int(words[2]))
    return found


def _ints(*words: str) -> bool:
    return all(w.isdigit() for w in words)
