"""Plan C, 2:4 semi-structured sparsity: in every group of 4 consecutive input weights of a
projection keep the 2 with the largest score (|w|, or Wanda's |w| * ||x_j|| when input norms
are given). On CPU this is a compliance and accuracy study on a masked copy of the weights;
with CUDA, `time_semi_structured` compares `to_sparse_semi_structured` against dense."""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sparse_engine.model.arch import LayerParts, find_layers, run_hooked
from sparse_engine.model.loader import LoadedModel, wrap

GROUP = 4


@dataclass(frozen=True, slots=True)
class Compliance:
    layer: int
    role: str
    share: float  # share of 4-groups with at least 2 zeros


def two_four_mask(weight: torch.Tensor, input_norm: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean keep-mask of `weight` (out, in): exactly 2 kept in each group of 4 inputs."""
    if weight.dim() != 2 or weight.shape[1] % GROUP:
        raise ValueError(f"2:4 needs a 2-D weight with inputs divisible by 4, got {weight.shape}")
    score = weight.detach().abs().float()
    if input_norm is not None:
        score = score * input_norm.float().to(score.device)[None, :]
    groups = score.reshape(weight.shape[0], -1, GROUP)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(-1, groups.topk(2, dim=-1).indices, True)
    return keep.reshape(weight.shape)


def compliance(weight: torch.Tensor) -> float:
    """Share of groups of 4 consecutive inputs that already hold at least 2 zeros."""
    if weight.shape[1] % GROUP:
        return 0.0
    zeros = (weight.detach().reshape(weight.shape[0], -1, GROUP) == 0).sum(-1)
    return float((zeros >= 2).float().mean())


def compliance_table(layers: Sequence[LayerParts], roles: Sequence[str]) -> list[Compliance]:
    return [
        Compliance(part.index, role, compliance(_weight(part, role)))
        for part in layers
        for role in roles
    ]


def input_norms(
    lm: LoadedModel, batches: Sequence[torch.Tensor], roles: Sequence[str]
) -> dict[tuple[int, str], torch.Tensor]:
    """Per-input-feature L2 norm of each projection's input over `batches` (Wanda's scale)."""
    sums: dict[tuple[int, str], torch.Tensor] = {}
    handles = []
    for part in lm.layers:
        for role in roles:
            hook = _norm_hook(sums, (part.index, role))
            handles.append(part.get(role).register_forward_pre_hook(hook))
    run_hooked(lm.model, handles, batches)
    return {key: total.sqrt() for key, total in sums.items()}


def semi24_copy(
    lm: LoadedModel,
    roles: Sequence[str],
    norms: Mapping[tuple[int, str], torch.Tensor] | None = None,
) -> LoadedModel:
    """A copy of `lm` whose `roles` projections are pruned to 2:4 in every layer."""
    model = copy.deepcopy(lm.model)
    for part in find_layers(model):
        for role in roles:
            weight = _weight(part, role)
            norm = None if norms is None else norms.get((part.index, role))
            with torch.no_grad():
                weight.mul_(two_four_mask(weight, norm).to(weight.dtype))
    return wrap(model, lm.tokenizer, f"{lm.model_id}-2:4", "unsaved")


def time_semi_structured(
    shapes: Sequence[tuple[int, int]], tokens: int = 64, repeats: int = 50
) -> list[dict[str, Any]] | None:
    """Median ms of a fp16 matmul, dense vs `to_sparse_semi_structured`, per (out, in) shape;
    None when no CUDA device is present (speed then is not measured)."""
    if not torch.cuda.is_available():
        return None
    from torch.sparse import to_sparse_semi_structured

    rows = []
    for out_f, in_f in shapes:
        rows.append(_time_shape(to_sparse_semi_structured, out_f, in_f, tokens, repeats))
    return rows


def _time_shape(
    convert: Callable[[torch.Tensor], Any], out_f: int, in_f: int, tokens: int, repeats: int
) -> dict[str, Any]:
    weight = torch.randn(out_f, in_f, device="cuda", dtype=torch.float16)
    weight = weight * two_four_mask(weight).to(weight.dtype)
    x = torch.randn(tokens, in_f, device="cuda", dtype=torch.float16)
    sparse = convert(weight)
    dense_ms = _median_ms(lambda: torch.nn.functional.linear(x, weight), repeats)
    sparse_ms = _median_ms(lambda: torch.nn.functional.linear(x, sparse), repeats)
    row = {"shape": [out_f, in_f], "tokens": tokens, "dense_ms": dense_ms, "sparse_ms": sparse_ms}
    return row | {"speedup": dense_ms / sparse_ms}


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def _norm_hook(sums: dict[tuple[int, str], torch.Tensor], key: tuple[int, str]) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0].detach().float()
        squares = x.pow(2).reshape(-1, x.shape[-1]).sum(0)
        sums[key] = sums[key] + squares if key in sums else squares

    return hook


def _weight(part: LayerParts, role: str) -> torch.Tensor:
    module = part.get(role)
    if not isinstance(module, nn.Linear):
        raise ValueError(f"2:4 needs nn.Linear projections; layer {part.index} {role} is not")
    return module.weight
