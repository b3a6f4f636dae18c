"""Where the parts of a Hugging Face decoder live: layers, attention, MLP and their projections.

One small table covers the Llama/Qwen2/Mistral family and GPT-2; hooks are attached to the
modules found here, never to patched forwards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

# Role -> candidate sub-module paths inside one decoder layer, first match wins.
ROLE_PATHS: dict[str, tuple[str, ...]] = {
    "q": ("self_attn.q_proj",),
    "k": ("self_attn.k_proj",),
    "v": ("self_attn.v_proj",),
    "qkv": ("attn.c_attn",),
    "o": ("self_attn.o_proj", "attn.c_proj"),
    "gate": ("mlp.gate_proj",),
    "up": ("mlp.up_proj", "mlp.c_fc"),
    "down": ("mlp.down_proj", "mlp.c_proj"),
    "attn": ("self_attn", "attn"),
    "mlp": ("mlp",),
}
Unit = tuple[str, int]  # (role, layer): one sparsified projection input
LAYER_LIST_PATHS = ("model.layers", "transformer.h", "model.decoder.layers", "gpt_neox.layers")


class UnsupportedModelError(ValueError):
    """The model's layout is not one the engine knows how to hook."""


@dataclass(frozen=True, slots=True)
class LayerParts:
    index: int
    modules: dict[str, nn.Module]

    def get(self, role: str) -> nn.Module:
        if role not in self.modules:
            raise UnsupportedModelError(
                f"layer {self.index} has no '{role}' module; available: {sorted(self.modules)}"
            )
        return self.modules[role]


def find_layers(model: nn.Module) -> list[LayerParts]:
    """Locate each decoder layer and its role modules."""
    layer_list = _find_layer_list(model)
    return [
        LayerParts(i, {"block": layer, **_find_roles(layer)}) for i, layer in enumerate(layer_list)
    ]


def input_width(module: nn.Module) -> int:
    """Number of input features of a linear-like module (nn.Linear or GPT-2's Conv1D)."""
    if isinstance(module, nn.Linear):
        return module.in_features
    weight = getattr(module, "weight", None)
    if weight is None or weight.dim() != 2:
        raise UnsupportedModelError(f"{type(module).__name__} is not a linear projection")
    return int(weight.shape[0])  # Conv1D stores weight as (in, out)


def _find_layer_list(model: nn.Module) -> nn.ModuleList:
    for path in LAYER_LIST_PATHS:
        module = _get(model, path)
        if isinstance(module, nn.ModuleList):
            return module
    raise UnsupportedModelError(
        f"cannot find decoder layers in {type(model).__name__}; "
        f"supported layouts: {', '.join(LAYER_LIST_PATHS)}"
    )


def _find_roles(layer: nn.Module) -> dict[str, nn.Module]:
    found: dict[str, nn.Module] = {}
    for role, paths in ROLE_PATHS.items():
        for path in paths:
            module = _get(layer, path)
            if module is not None:
                found[role] = module
                break
    return found


def _get(root: nn.Module, path: str) -> nn.Module | None:
    module: nn.Module | None = root
    for name in path.split("."):
        module = getattr(module, name, None)
        if not isinstance(module, nn.Module):
            return None
    return module


def run_hooked(
    model: nn.Module,
    handles: Iterable[RemovableHandle],
    batches: Iterable[torch.Tensor],
    each: Callable[[torch.Tensor], None] | None = None,
) -> None:
    """Run `batches` (token id tensors) through `model` without gradients, calling `each` with
    each batch after its pass, for the hooks behind `handles`, which are removed afterwards
    whatever happens."""
    try:
        with torch.inference_mode():
            for ids in batches:
                model(input_ids=ids)
                if each is not None:
                    each(ids)
    finally:
        for handle in handles:
            handle.remove()
