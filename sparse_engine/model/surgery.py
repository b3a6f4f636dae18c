"""Replacing a decoder's MLP projections with fresh `nn.Linear` modules of other shapes: the
loader uses it to build a pruned model from its original config, the pruner to cut channels."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from torch import nn

from sparse_engine.model.arch import LayerParts, UnsupportedModelError


def resize_mlps(layers: Sequence[LayerParts], sizes: Sequence[int], bias: set[int]) -> None:
    """Give each layer's gate/up/down fresh Linear modules of the pruned shapes, so a state
    dict of a pruned model loads into a model built from the original config."""
    for part, size in zip(layers, sizes, strict=True):
        mlp = part.get("mlp")
        for role in ("gate", "up"):
            old = mlp_linear(part, role)
            replace_child(mlp, old, empty_like(old, old.in_features, size, old.bias is not None))
        old = mlp_linear(part, "down")
        has_bias = old.bias is not None or part.index in bias
        replace_child(mlp, old, empty_like(old, size, old.out_features, has_bias))


def empty_like(old: nn.Linear, fan_in: int, fan_out: int, bias: bool) -> nn.Linear:
    # Built on the meta device, then allocated uninitialised: the weights are overwritten at
    # once, and a zero-width layer (a removed MLP) cannot be initialised anyway.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Initializing zero-element tensors")
        new = nn.Linear(fan_in, fan_out, bias=bias, device="meta", dtype=old.weight.dtype)
    return new.to_empty(device=old.weight.device)


def mlp_linear(part: LayerParts, role: str) -> nn.Linear:
    module = part.get(role)
    if not isinstance(module, nn.Linear):
        raise UnsupportedModelError(
            f"pruning needs nn.Linear {role} projections (Llama/Qwen2/Mistral-style SwiGLU "
            f"MLPs); layer {part.index} has {type(module).__name__}"
        )
    return module


def replace_child(parent: nn.Module, old: nn.Module, new: nn.Module) -> None:
    for name, child in parent.named_children():
        if child is old:
            setattr(parent, name, new)
            return
    raise UnsupportedModelError(f"{type(old).__name__} is not a direct child of the MLP")
