"""Plan A, runtime masking: silence FFN channels and whole MLPs with removable hooks, no weight
change. A `ChannelMask` says which FFN intermediate channels (the down-projection input) to
zero, which to hold at a constant (bias-like channels, as plan B folds them), and which
layers' MLP to switch off; `masked(layers, mask)` applies it for the duration of a block."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from sparse_engine.model.arch import LayerParts, input_width


@dataclass(frozen=True, slots=True)
class ChannelMask:
    """`channels`: layer -> FFN intermediate channels to zero. `constants`: layer ->
    (channel, value) pairs held at that value (a bias-like channel replaced by its mean, which
    is exactly what folding it into a down-projection bias computes). `layers`: layers whose
    MLP output is zeroed, so the residual stream passes the block's MLP unchanged; attention
    still runs, because a silent MLP says nothing about the attention of the same block."""

    channels: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    layers: tuple[int, ...] = ()
    constants: Mapping[int, tuple[tuple[int, float], ...]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        has_channels = any(self.channels.values()) or any(self.constants.values())
        return not has_channels and not self.layers

    def digest(self) -> str:
        """A short stable id of the mask, for cache keys and reports."""
        body = {
            "channels": {str(k): list(v) for k, v in sorted(self.channels.items())},
            "layers": sorted(self.layers),
            "constants": {str(k): [list(p) for p in v] for k, v in sorted(self.constants.items())},
        }
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:12]

    def check_fits(self, layers: Sequence[LayerParts]) -> None:
        """Raise ValueError when a layer or channel index is outside the model."""
        for index in (*self.layers, *self.channels, *self.constants):
            if not 0 <= index < len(layers):
                raise ValueError(
                    f"mask names layer {index} but the model has layers 0..{len(layers) - 1}"
                )
        for index, picked in (*self.channels.items(), *_constant_channels(self.constants)):
            width = input_width(layers[index].get("down"))
            bad = [c for c in picked if not 0 <= c < width]
            if bad:
                raise ValueError(
                    f"mask names channels {bad[:5]} of layer {index}, whose MLP has {width}"
                )


def parse_layer_list(text: str | None) -> tuple[int, ...]:
    """'7,8,9' -> (7, 8, 9); None or '' -> ()."""
    if not text:
        return ()
    try:
        return tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        raise ValueError(
            f"--silent-layers takes comma-separated layer numbers, not {text!r}"
        ) from None


@contextmanager
def masked(layers: Sequence[LayerParts], mask: ChannelMask | None) -> Iterator[None]:
    """Apply `mask` to the model whose `layers` are given; a None or empty mask does nothing."""
    handles: list[RemovableHandle] = []
    try:
        if mask is not None and not mask.is_empty:
            mask.check_fits(layers)
            for part in layers:
                handles.extend(_attach(part, mask))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _attach(part: LayerParts, mask: ChannelMask) -> list[RemovableHandle]:
    handles = []
    zeroed = mask.channels.get(part.index, ())
    held = mask.constants.get(part.index, ())
    if zeroed or held:
        down = part.get("down")
        handles.append(down.register_forward_pre_hook(_channel_hook(zeroed, held)))
    if part.index in mask.layers:
        handles.append(part.get("mlp").register_forward_hook(_zero_output_hook))
    return handles


def _channel_hook(zeroed: tuple[int, ...], held: tuple[tuple[int, float], ...]) -> Any:
    zero_index = torch.tensor(zeroed, dtype=torch.long)
    held_index = torch.tensor([c for c, _ in held], dtype=torch.long)
    held_value = torch.tensor([v for _, v in held], dtype=torch.float64)

    def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]
        if zero_index.numel():
            x = x.index_fill(-1, zero_index.to(x.device), 0.0)
        if held_index.numel():
            value = held_value.to(device=x.device, dtype=x.dtype).expand(*x.shape[:-1], -1)
            x = x.index_copy(-1, held_index.to(x.device), value.contiguous())
        return (x, *args[1:])

    return hook


def _zero_output_hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    if isinstance(output, tuple):
        return (torch.zeros_like(output[0]), *output[1:])
    return torch.zeros_like(output)


def _constant_channels(
    constants: Mapping[int, tuple[tuple[int, float], ...]],
) -> list[tuple[int, tuple[int, ...]]]:
    return [(layer, tuple(c for c, _ in pairs)) for layer, pairs in constants.items()]


def read_silent_channels(path: Path) -> dict[int, list[int]]:
    """Layer -> silent FFN channels from a silence map JSON. Protected layers and bias-like
    channels are left out: the first are never pruned, the second are folded, not zeroed."""
    data = _read_map(path)
    protected = set(data.get("protected_layers", []))
    found: dict[int, list[int]] = {}
    for entry in data["layers"]:
        layer = int(entry["layer"])
        bias_like = set(entry["mlp"].get("bias_like", []))
        silent = [int(c) for c in entry["mlp"].get("silent", []) if c not in bias_like]
        if silent and layer not in protected:
            found[layer] = sorted(silent)
    return found


def read_bias_like(path: Path) -> dict[int, list[tuple[int, float]]]:
    """Layer -> (channel, signed mean activation) of the bias-like channels of a silence map."""
    data = _read_map(path)
    protected = set(data.get("protected_layers", []))
    found: dict[int, list[tuple[int, float]]] = {}
    for entry in data["layers"]:
        layer, mlp = int(entry["layer"]), entry["mlp"]
        pairs = [(int(c), float(mlp["signed_mean"][c])) for c in mlp.get("bias_like", [])]
        if pairs and layer not in protected:
            found[layer] = sorted(pairs)
    return found


def map_weights_sha256(path: Path) -> str | None:
    """The weights hash the silence map was measured on (None if it does not say)."""
    value = _read_map(path).get("weights_sha256")
    return str(value) if value else None


def mask_from_map(
    path: Path | None, silent_layers: tuple[int, ...] = (), fold_bias_like: bool = False
) -> ChannelMask:
    """The plan-A mask of a silence map (optionally holding bias-like channels at their mean,
    as folding does) plus whole listed layers."""
    if path is None:
        return ChannelMask(layers=silent_layers)
    channels = {k: tuple(v) for k, v in read_silent_channels(path).items()}
    constants = {k: tuple(v) for k, v in read_bias_like(path).items()} if fold_bias_like else {}
    return ChannelMask(channels, silent_layers, constants)


def _read_map(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(
            f"silence map not found: {path}; run `sparseguard silence-map --out DIR` first"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not a silence map JSON: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("layers"), list):
        raise ValueError(f"{path} is not a silence map: it has no 'layers' list")
    return data
