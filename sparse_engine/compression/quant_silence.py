"""Quantisation against silence: simulated int8, 4-bit and fp8 weights of every linear
projection (q, k, v, o, gate, up, down), put into a loaded model in place and restored after,
with an optional "lift" of chosen channels' reading weights; and what each weight type does
to those weights (`quant_survey` measures silence, sparsity and perplexity).

Weight types (simulated: each weight is quantised and dequantised back to float32, so the
forward pass is the float32 reference on rounded weights; no model file is touched):
- "int8": the fast path's rule, by `fast_weights.Matrix.of` itself. Projections sharing an
  input are fused (q/k/v, gate/up) and stored input-major, with one scale (amax / 127) per
  input-major row: per input channel of the Hugging Face weight, shared by the fused outputs.
- "q4": symmetric 4-bit, one scale (amax / 7, codes -7..7) per output row and group of 32
  consecutive input columns: the block shape of GGUF's Q4_0, without its -8 code.
- "fp8": float8 e4m3 (`torch.float8_e4m3fn`) round trip with one scale (amax / 448) per
  output row.

The lift, as tested here: channel c's reading weights W[:, c] (the `down` input columns of
an MLP channel, the `o` input columns of an attention channel) are multiplied by 1.5 before
quantising and divided by 1.5 after dequantising, in float64, where both steps are exact for
float32 weights: only the rounding differs. The published claim read as: lifted silent
channels' weights are less often rounded to zero and their contribution a_c * W[:, c] is
kept closer. `Damage` measures exactly that, on the lifted channels S: the share of their
non-zero weights rounded to exactly 0, and ||Q(W)[:, S] - W[:, S]|| / ||W[:, S]|| (the
contribution's relative error for any activation, since a_c scales the whole
column); the same error over all columns shows what a lift costs the channels that share
its scale.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from sparse_engine.compression.silence import KIND_ROLES, ChannelSite
from sparse_engine.model.arch import LayerParts
from sparse_engine.runtime.fast_weights import Matrix

FUSED = (("q", "k", "v"), ("o",), ("gate", "up"), ("down",))  # as the fast path fuses them
Q4_GROUP, Q4_MAX = 32, 7
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
LIFT = 1.5
Group = dict[str, torch.Tensor]  # role -> weight (out, in) of projections sharing one input
Quantiser = Callable[[Group], Group]
Originals = dict[tuple[int, str], torch.Tensor]  # (layer, role) -> the float32 weight
Channels = dict[ChannelSite, list[int]]


def int8_fast_path(group: Group) -> Group:
    """The fast path's int8 weights, dequantised: `Matrix.of` over the fused group."""
    holders = {role: SimpleNamespace(weight=w, bias=None) for role, w in group.items()}
    matrix = Matrix.of(holders, torch.int8)
    rows = matrix.float_rows()
    return {role: rows[:, a:b].T.to(group[role].dtype) for role, a, b in matrix.parts}


def q4_blocks(w: torch.Tensor) -> torch.Tensor:
    """Symmetric 4-bit per (output row, 32 input columns), dequantised."""
    out, width = w.shape
    blocks = F.pad(w, (0, -width % Q4_GROUP)).reshape(out, -1, Q4_GROUP)
    scale = (blocks.abs().amax(-1, keepdim=True) / Q4_MAX).clamp_min(1e-12)
    codes = (blocks / scale).round().clamp(-Q4_MAX, Q4_MAX)
    return (codes * scale).reshape(out, -1)[:, :width]


def fp8_rows(w: torch.Tensor) -> torch.Tensor:
    """float8 e4m3 with one scale per output row, dequantised."""
    scale = (w.abs().amax(1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    return (w / scale).to(torch.float8_e4m3fn).to(w.dtype) * scale


def _each(quantise: Callable[[torch.Tensor], torch.Tensor]) -> Quantiser:
    return lambda group: {role: quantise(w) for role, w in group.items()}


QUANTISERS: dict[str, Quantiser] = {
    "float32": dict,
    "int8": int8_fast_path,
    "q4": _each(q4_blocks),
    "fp8": _each(fp8_rows),
}


def quantiser(name: str) -> Quantiser:
    if name not in QUANTISERS:
        raise ValueError(f"unknown weight type '{name}'; choose from: {', '.join(QUANTISERS)}")
    return QUANTISERS[name]


def rescaled(w: torch.Tensor, columns: list[int], factor: float, divide: bool) -> torch.Tensor:
    """`w` in float64 with `columns` multiplied (or divided) by `factor`."""
    out = w.double().clone()
    if columns:
        out[:, columns] = out[:, columns] / factor if divide else out[:, columns] * factor
    return out


def quantise_group(
    group: Group, quantise: Quantiser, lift: dict[str, list[int]], factor: float = LIFT
) -> Group:
    """`group` through `quantise` in float64, each role's `lift` columns multiplied by
    `factor` before and divided after; returned in the group's dtypes."""
    scaled = {r: rescaled(w, lift.get(r, []), factor, divide=False) for r, w in group.items()}
    done = quantise(scaled)
    return {
        r: rescaled(done[r], lift.get(r, []), factor, divide=True).to(w.dtype)
        for r, w in group.items()
    }


def _lift_columns(layer: int, lift: Channels) -> dict[str, list[int]]:
    return {KIND_ROLES[kind]: cols for (index, kind), cols in lift.items() if index == layer}


@contextmanager
def quantised(
    layers: list[LayerParts],
    quantise: Quantiser,
    lift: Channels | None = None,
    factor: float = LIFT,
) -> Iterator[Originals]:
    """Every q/k/v/o/gate/up/down weight of `layers` replaced by its quantised copy for the
    block (the channels in `lift` lifted by `factor`) and restored bit for bit after.
    Yields the float32 originals, for measuring what changed."""
    originals: Originals = {}
    try:
        with torch.no_grad():
            for part in layers:
                columns = _lift_columns(part.index, lift or {})
                for roles in FUSED:
                    group = {r: weight(part, r) for r in roles}
                    originals.update({(part.index, r): w.clone() for r, w in group.items()})
                    for r, w in quantise_group(group, quantise, columns, factor).items():
                        weight(part, r).copy_(w)
        yield originals
    finally:
        with torch.no_grad():
            for (layer, role), w in originals.items():
                weight(layers[layer], role).copy_(w)


def weight(part: LayerParts, role: str) -> torch.Tensor:
    """The weight parameter of `role` in layer `part`, as a tensor."""
    tensor = part.get(role).weight
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"layer {part.index} '{role}' has no weight tensor")
    return tensor


def fingerprint(layers: list[LayerParts]) -> str:
    """A hash of every quantised role's weights: equal weights give equal measurements."""
    digest = hashlib.blake2b(digest_size=16)
    for part in layers:
        for role in (r for roles in FUSED for r in roles):
            digest.update(weight(part, role).detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class Damage:
    """What quantisation did to the reading weights (`down`, `o`): of the listed channels'
    columns, non-zero float32 weights and those rounded to exactly 0, with squared error and
    squared norm; and the same four over all columns."""

    weights: int
    zeroed: int
    error_sq: float
    norm_sq: float
    all_error_sq: float
    all_norm_sq: float
    all_weights: int
    all_zeroed: int

    @property
    def zeroed_share(self) -> float:
        return self.zeroed / self.weights if self.weights else 0.0

    @property
    def all_zeroed_share(self) -> float:
        return self.all_zeroed / self.all_weights if self.all_weights else 0.0

    @property
    def relative_error(self) -> float:
        return (self.error_sq / self.norm_sq) ** 0.5 if self.norm_sq else 0.0

    @property
    def all_relative_error(self) -> float:
        return (self.all_error_sq / self.all_norm_sq) ** 0.5 if self.all_norm_sq else 0.0


def damage(layers: list[LayerParts], originals: Originals, channels: Channels) -> Damage:
    """`Damage` of the weights now in `layers` against `originals`, on `channels`' columns."""
    sums = [0.0] * 8
    for part in layers:
        for kind, role in KIND_ROLES.items():
            w = originals[(part.index, role)].double()
            q = weight(part, role).detach().double()
            cols = channels.get((part.index, kind), [])
            picked = _sums(w[:, cols], q[:, cols])
            whole = _sums(w, q)
            sums = [a + b for a, b in zip(sums, [*picked, *whole], strict=True)]
    return Damage(
        int(sums[0]), int(sums[1]), sums[2], sums[3], sums[6], sums[7], int(sums[4]), int(sums[5])
    )


def _sums(w: torch.Tensor, q: torch.Tensor) -> list[float]:
    """Non-zero weights, those now zero, squared error, squared norm."""
    live = w != 0
    return [
        float(live.sum()),
        float((live & (q == 0)).sum()),
        float((q - w).pow(2).sum()),
        float(w.pow(2).sum()),
    ]
