"""Learned gates: one gate per MLP channel, `g = sigmoid(W_g [x ; LayerNorm(x)] + b)`, where
`x` is the MLP input; channel i of the FFN intermediate (the down-projection input) is kept
when `g_i > THRESHOLD` and zeroed otherwise. Kept channels pass unscaled, so a plan that keeps
every channel is the dense model exactly.

`W_g` is low rank (`up @ down`, rank 64 by default): a full-rank gate of SmolLM2 would have
2 x 576 x 1536 weights per layer, two thirds of the MLP it gates, and reading it would cost
more than the channels it skips save. At rank 64 the gates are 3.9 % of the model.

Training uses a straight-through mask: the hard 0/1 decision forward, the sigmoid's gradient
backward (`hard + g - g.detach()`). A plan shifts every gate's logit by one `offset`, which
is what calibration moves to meet a level's budget.

Gate confidence of a gate plan (the per-request signal) is read from the gate values: per
token, the mean over channels of how far each gate sits from the threshold as a share of the
room on its side, `(g - t) / (1 - t)` above and `(t - g) / t` below: 1 when every gate is
at 0 or 1, 0 when every gate sits on the threshold."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.hooks import RemovableHandle

from sparse_engine.model.arch import LayerParts, input_width
from sparse_engine.sparsity.sink import keep_sink

THRESHOLD = 0.1
DEFAULT_RANK = 64
OPEN_LOGIT = 0.0  # initial bias: every gate starts open (sigmoid(0) = 0.5)


class GateObserver(Protocol):
    """What a signal recorder takes from a gated projection (see `SignalRecorder`)."""

    def observe_sparsified(
        self,
        layer: int,
        magnitude: torch.Tensor,
        kept: torch.Tensor,
        share: torch.Tensor | None = None,
    ) -> None: ...

    def observe_channels(self, layer: int, magnitude: torch.Tensor) -> None: ...


class Gates(nn.Module):
    """The gates of every MLP of one model: per layer `down` (rank, 2 x hidden), `up`
    (channels, rank) and `bias` (channels)."""

    def __init__(self, hidden: int, channels: Sequence[int], rank: int = DEFAULT_RANK) -> None:
        super().__init__()
        self.hidden, self.rank = hidden, rank
        self.down = nn.ParameterList(
            nn.Parameter(torch.randn(rank, 2 * hidden) / (2 * hidden) ** 0.5) for _ in channels
        )
        self.up = nn.ParameterList(nn.Parameter(torch.zeros(m, rank)) for m in channels)
        self.bias = nn.ParameterList(nn.Parameter(torch.full((m,), OPEN_LOGIT)) for m in channels)
        self.version = ""

    @classmethod
    def for_layers(cls, layers: Sequence[LayerParts], hidden: int, rank: int) -> Gates:
        return cls(hidden, [input_width(part.get("down")) for part in layers], rank)

    @property
    def num_layers(self) -> int:
        return len(self.bias)

    def logits(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Gate logits of `layer` for MLP inputs `x` (..., hidden)."""
        feats = features(x.to(self.down[layer].dtype))
        return F.linear(F.linear(feats, self.down[layer]), self.up[layer], self.bias[layer])

    def save(self, path: Path, meta: dict[str, Any]) -> str:
        """Write the tensors (safetensors) and `meta` beside them (JSON); the tensors' sha256."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {name: p.detach().contiguous() for name, p in self.named_parameters()}
        header = {"hidden": str(self.hidden), "rank": str(self.rank), "version": self.version}
        save_file(tensors, str(path), metadata=header)
        digest = file_sha256(path)
        record = {**meta, "version": self.version, "sha256": digest, "rank": self.rank}
        path.with_suffix(".json").write_text(json.dumps(record, indent=1))
        return digest


def features(x: torch.Tensor) -> torch.Tensor:
    """A gate's input features `[x ; LayerNorm(x)]` of MLP inputs `x` (..., hidden)."""
    return torch.cat([x, F.layer_norm(x, x.shape[-1:])], dim=-1)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@functools.lru_cache(maxsize=8)
def load_gates(path: str, sha256: str | None = None) -> Gates:
    """The gates in `path`, checked against `sha256` when given; cached, never trained."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"gate artefact not found: {file}; run `sparseguard train-gates`")
    if sha256 is not None and file_sha256(file) != sha256:
        raise ValueError(f"gate artefact {file} does not match its pinned sha256 {sha256[:12]}")
    tensors = load_file(str(file))
    count = len([k for k in tensors if k.startswith("bias.")])
    channels = [tensors[f"bias.{i}"].numel() for i in range(count)]
    hidden = tensors["down.0"].shape[1] // 2
    gates = Gates(hidden, channels, tensors["down.0"].shape[0])
    gates.load_state_dict(tensors)
    gates.requires_grad_(False)
    gates.version = file.stem
    return gates


def confidence(g: torch.Tensor) -> torch.Tensor:
    """Per token (last dim reduced): the gates' mean distance from the threshold as a share of
    the room on their side (see the module docstring)."""
    above = (g - THRESHOLD) / (1.0 - THRESHOLD)
    below = (THRESHOLD - g) / THRESHOLD
    return torch.where(g > THRESHOLD, above, below).mean(-1)


def attach(
    part: LayerParts,
    gates: Gates,
    offset: float,
    recorder: GateObserver | None = None,
    straight_through: bool = False,
    actives: list[torch.Tensor] | None = None,
    sink: list[bool] | None = None,
) -> list[RemovableHandle]:
    """Gate `part`'s MLP: the logits come from the MLP's input, the mask goes on the
    down-projection's input. `actives` collects each call's (straight-through) kept share.
    `sink` (served plans, `sparsity.sink`): position 0 stays open when the call holds it."""
    held: list[torch.Tensor] = []

    def before_mlp(module: nn.Module, args: tuple[Any, ...]) -> None:
        held.append(gates.logits(part.index, args[0]) + offset)

    def before_down(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x, g = args[0], torch.sigmoid(held.pop())
        kept = g > THRESHOLD if sink is None else keep_sink(g > THRESHOLD, sink)
        mask = kept.to(g.dtype)
        if straight_through:
            mask = mask + g - g.detach()
        if actives is not None:
            actives.append(mask.mean())
        if recorder is not None:
            magnitude = x.abs()
            recorder.observe_sparsified(part.index, magnitude, kept, share=confidence(g))
            recorder.observe_channels(part.index, magnitude)
        return ((x * mask).to(x.dtype), *args[1:])

    return [
        part.get("mlp").register_forward_pre_hook(before_mlp),
        part.get("down").register_forward_pre_hook(before_down),
    ]


@contextmanager
def gated(
    layers: Sequence[LayerParts],
    gates: Gates,
    offset: float = 0.0,
    straight_through: bool = False,
    actives: list[torch.Tensor] | None = None,
) -> Iterator[None]:
    """Gate every MLP of the model for the duration of the block (training and studies)."""
    handles: list[RemovableHandle] = []
    try:
        for part in layers:
            handles.extend(attach(part, gates, offset, None, straight_through, actives))
        yield
    finally:
        for handle in handles:
            handle.remove()


def offset_for(logits: torch.Tensor, target: float) -> float:
    """The logit shift at which a share `target` of `logits` (a sample of gate logits at offset
    0) falls at or under the threshold."""
    if not 0.0 <= target < 1.0:
        raise ValueError(f"target sparsity must be in [0, 1), got {target}")
    cut = torch.logit(torch.tensor(THRESHOLD, dtype=torch.float64))
    return float(cut - torch.quantile(logits.double(), target))


def logit_sample(
    layers: Sequence[LayerParts],
    gates: Gates,
    run: Callable[[], object],
    limit: int = 1 << 22,
) -> torch.Tensor:
    """Every gate logit (offset 0) of the forward passes `run` makes, flattened; at most
    `limit` values, evenly thinned, so that a quantile stays cheap."""
    found: list[torch.Tensor] = []
    handles = [
        part.get("mlp").register_forward_pre_hook(
            lambda m, a, i=part.index: found.append(gates.logits(i, a[0]).flatten())
        )
        for part in layers
    ]
    try:
        with torch.inference_mode():
            run()
    finally:
        for handle in handles:
            handle.remove()
    values = torch.cat(found)
    step = max(1, values.numel() // limit)
    return values[::step]
