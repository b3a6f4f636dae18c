"""Sparsity as removable hooks: forward pre-hooks zero small inputs of linear projections
(threshold sparsifier) or the MLP channels whose learned gate is closed (`sparsity.gates`),
forward hooks keep the Top-K dims of attention/MLP block outputs before the residual add.
Leaving `sparsified(...)` removes every hook. `read_out(...)` reads the trust readout
(`sparsity.readout`) off the same passes the same way.

The first position of a sequence is never sparsified (`sparsity.sink`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from sparse_engine.model.arch import LayerParts
from sparse_engine.sparsity import gates
from sparse_engine.sparsity.plan import SparsityPlan
from sparse_engine.sparsity.readout import Readout
from sparse_engine.sparsity.recorder import SignalRecorder
from sparse_engine.sparsity.sink import keep_sink, sink_hook


@contextmanager
def sparsified(
    layers: list[LayerParts], plan: SparsityPlan, recorder: SignalRecorder | None = None
) -> Iterator[None]:
    """Apply `plan` to the model whose `layers` are given, for the duration of the block."""
    handles: list[RemovableHandle] = []
    try:
        for part in layers:
            handles.extend(_attach(part, plan, recorder))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _attach(
    part: LayerParts, plan: SparsityPlan, recorder: SignalRecorder | None
) -> list[RemovableHandle]:
    sink = [False]  # whether this layer's current call holds position 0 as its first row
    handles = [part.get("block").register_forward_pre_hook(sink_hook(sink), with_kwargs=True)]
    for role, per_layer in plan.thresholds.items():
        hook = _threshold_hook(part.index, per_layer[part.index], recorder, role == "down", sink)
        handles.append(part.get(role).register_forward_pre_hook(hook))
    if plan.gates is not None:
        handles.extend(gates.attach(part, plan.gates, plan.gate_offset, recorder, sink=sink))
    elif recorder is not None and "down" not in plan.thresholds:
        hook = _channel_hook(part.index, recorder)
        handles.append(part.get("down").register_forward_pre_hook(hook))
    if plan.topk is not None:
        k = plan.topk[part.index]
        for role in ("attn", "mlp"):
            handles.append(
                part.get(role).register_forward_hook(_topk_hook(part.index, k, recorder, sink))
            )
    return handles


def _threshold_hook(
    layer: int,
    threshold: float,
    recorder: SignalRecorder | None,
    is_mlp_input: bool,
    sink: list[bool],
) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]
        magnitude = x.abs()
        kept = keep_sink(magnitude > threshold, sink)
        if recorder is not None:
            recorder.observe_sparsified(layer, magnitude, kept)
            if is_mlp_input:
                recorder.observe_channels(layer, magnitude)
        return (x * kept, *args[1:])

    return hook


def _channel_hook(layer: int, recorder: SignalRecorder) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        recorder.observe_channels(layer, args[0].abs())

    return hook


def _topk_hook(layer: int, k: int, recorder: SignalRecorder | None, sink: list[bool]) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        h = output[0] if isinstance(output, tuple) else output
        magnitude = h.abs()
        if k >= h.shape[-1]:
            kept = torch.ones_like(h, dtype=torch.bool)
        else:
            index = magnitude.topk(k, dim=-1).indices
            kept = keep_sink(torch.zeros_like(h, dtype=torch.bool).scatter_(-1, index, True), sink)
        if recorder is not None:
            recorder.observe_sparsified(layer, magnitude, kept)
        return (h * kept, *output[1:]) if isinstance(output, tuple) else h * kept

    return hook


@contextmanager
def read_out(model: nn.Module, layers: list[LayerParts], readout: Readout) -> Iterator[None]:
    """Fill `readout` from the forward calls inside the block: each decoder layer's output and
    each attention's probabilities. Attention runs eagerly meanwhile (SDPA returns no
    probabilities); the hook reduces each layer's probabilities to the answer's queries at
    once, so no more than one layer's are held. Set `readout.cursor` to the first row's
    position before each call."""
    previous = getattr(model.config, "_attn_implementation", None) or "sdpa"
    handles: list[RemovableHandle] = []
    model.set_attn_implementation("eager")  # type: ignore[operator]
    try:
        for part in layers:
            handles.append(
                part.get("block").register_forward_hook(_hidden_hook(part.index, readout))
            )
            handles.append(
                part.get("attn").register_forward_hook(_attention_hook(part.index, readout))
            )
        yield
    finally:
        for handle in handles:
            handle.remove()
        model.set_attn_implementation(previous)  # type: ignore[operator]


def _hidden_hook(layer: int, readout: Readout) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        h = output[0] if isinstance(output, tuple) else output
        if readout.wants(readout.cursor, h.shape[-2]):
            readout.observe_hidden(layer, h.reshape(-1, h.shape[-1]), readout.cursor)

    return hook


def _attention_hook(layer: int, readout: Readout) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        probs = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        if probs is not None and readout.wants(readout.cursor, probs.shape[-2]):
            # a batch goes whole to a reader of batches (`readout.RowReadouts`)
            rows = probs[0] if probs.shape[0] == 1 else probs
            readout.observe_attention(layer, rows, readout.cursor)

    return hook
