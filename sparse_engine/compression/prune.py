"""Plan B, structural pruning: remove silent FFN channels from the weights (gate/up rows, down
columns), fold bias-like channels into a down-projection bias, write a smaller model directory
that `load_model` reads back (per-layer sizes may differ), and verify it against plan A."""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sparse_engine.model.arch import LayerParts, find_layers, input_width
from sparse_engine.model.loader import LoadedModel, wrap
from sparse_engine.model.model_dir import MARKER_NAME, weights_sha256, write_marker
from sparse_engine.model.surgery import empty_like, mlp_linear, replace_child
from sparse_engine.sparsity.masking import ChannelMask, masked

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PruneResult:
    out_dir: Path
    intermediate_sizes: list[int]
    params_before: int
    params_after: int
    bytes_on_disk: int


@dataclass(frozen=True, slots=True)
class Verification:
    tokens_equal: bool
    max_abs_logit_diff: float
    tolerance: float
    num_prompts: int
    mismatched_prompts: list[int]

    @property
    def passed(self) -> bool:
        return self.tokens_equal and self.max_abs_logit_diff <= self.tolerance


def pruned_copy(
    lm: LoadedModel,
    channels: Mapping[int, Sequence[int]],
    bias_like: Mapping[int, Sequence[tuple[int, float]]] | None = None,
) -> LoadedModel:
    """A copy of `lm` without the given FFN channels; each bias-like (channel, value) is
    removed too and its constant contribution value * W_down[:, channel] added to a bias."""
    model = copy.deepcopy(lm.model)
    for part in find_layers(model):
        removed = set(channels.get(part.index, ()))
        folded = list((bias_like or {}).get(part.index, ()))
        if removed or folded:
            _prune_layer(part, removed, folded)
    return wrap(model, lm.tokenizer, f"{lm.model_id}-pruned", "unsaved")


def prune(
    lm: LoadedModel,
    channels: Mapping[int, Sequence[int]],
    out_dir: Path,
    bias_like: Mapping[int, Sequence[tuple[int, float]]] | None = None,
) -> tuple[LoadedModel, PruneResult]:
    """Prune `lm` and save it to `out_dir`; returns the pruned model (loaded back) and sizes."""
    pruned = pruned_copy(lm, channels, bias_like)
    sizes = intermediate_sizes(pruned.layers)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MARKER_NAME).unlink(missing_ok=True)  # a stale marker would carry a stale hash
    pruned.model.save_pretrained(out_dir)
    lm.tokenizer.save_pretrained(out_dir)
    bias_layers = [p.index for p in pruned.layers if mlp_linear(p, "down").bias is not None]
    source = {"pruned_from": lm.model_id, "weights_sha256": lm.weights_sha256}
    write_marker(out_dir, source, {"intermediate_sizes": sizes, "down_bias_layers": bias_layers})
    saved = wrap(pruned.model, lm.tokenizer, out_dir.name, weights_sha256(out_dir))
    result = PruneResult(
        out_dir, sizes, num_parameters(lm.model), num_parameters(pruned.model), _dir_bytes(out_dir)
    )
    return saved, result


def intermediate_sizes(layers: Sequence[LayerParts]) -> list[int]:
    return [input_width(part.get("down")) for part in layers]


def num_parameters(model: nn.Module) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


def verify(
    pruned: LoadedModel,
    reference: LoadedModel,
    mask: ChannelMask,
    prompts: Sequence[str],
    max_new_tokens: int = 16,
    tolerance: float = 1e-3,
) -> Verification:
    """Greedy tokens of the pruned model and of `reference` under plan A `mask` must be equal
    on every prompt, and logits (teacher-forced on the reference's tokens) within tolerance."""
    worst, mismatched = 0.0, []
    for i, prompt in enumerate(prompts):
        ids = list(reference.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        with masked(reference.layers, mask):
            ref_tokens, ref_logits = greedy(reference.model, ids, max_new_tokens)
        tokens, _ = greedy(pruned.model, ids, max_new_tokens)
        if tokens != ref_tokens:
            mismatched.append(i)
        logits = _logits(pruned.model, ids + ref_tokens[:-1])[len(ids) - 1 :]
        worst = max(worst, float((logits - ref_logits).abs().max()))
    return Verification(not mismatched, worst, tolerance, len(prompts), mismatched)


def greedy(model: nn.Module, ids: list[int], max_new_tokens: int) -> tuple[list[int], Any]:
    """Greedy continuation (full recompute per step: short, exact, no cache involved) and the
    logits that chose each token."""
    tokens: list[int] = []
    for _ in range(max_new_tokens):
        logits = _logits(model, ids + tokens)
        tokens.append(int(logits[-1].argmax()))
    return tokens, _logits(model, ids + tokens[:-1])[len(ids) - 1 :]


def _logits(model: nn.Module, ids: list[int]) -> Any:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def _prune_layer(part: LayerParts, removed: set[int], folded: list[tuple[int, float]]) -> None:
    gate, up, down = mlp_linear(part, "gate"), mlp_linear(part, "up"), mlp_linear(part, "down")
    drop = removed | {c for c, _ in folded}
    kept = [c for c in range(down.in_features) if c not in drop]
    # A removed MLP keeps one channel, zeroed (output exactly 0, plus any folded bias):
    # zero-width tensors break the per-channel signal recorder and some kernels.
    keep = torch.tensor(kept or [0], dtype=torch.long)
    mlp = part.get("mlp")
    with torch.no_grad():
        new = [_rows(gate, keep), _rows(up, keep), _columns(down, keep, folded)]
        for old, module in zip((gate, up, down), new, strict=True):
            replace_child(mlp, old, module)
            if not kept:
                module.weight.zero_()
        if not kept:
            for module in new[:2]:
                if module.bias is not None:
                    module.bias.zero_()


def _rows(old: nn.Linear, keep: torch.Tensor) -> nn.Linear:
    new = empty_like(old, old.in_features, keep.numel(), old.bias is not None)
    new.weight.copy_(old.weight[keep])
    if old.bias is not None and new.bias is not None:
        new.bias.copy_(old.bias[keep])
    return new


def _columns(old: nn.Linear, keep: torch.Tensor, folded: list[tuple[int, float]]) -> nn.Linear:
    new = empty_like(old, keep.numel(), old.out_features, old.bias is not None or bool(folded))
    new.weight.copy_(old.weight[:, keep])
    if new.bias is not None:
        bias = old.bias.double() if old.bias is not None else torch.zeros(old.out_features)
        for channel, value in folded:
            bias = bias.double() + value * old.weight[:, channel].double()
        new.bias.copy_(bias.to(new.bias.dtype))
    return new


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())
