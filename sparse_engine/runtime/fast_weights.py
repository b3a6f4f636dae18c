"""The fast path's weights: each decoder layer's projections taken out of the Hugging Face
model once, fused where they share an input (q/k/v, gate/up) and stored input-major (row i is
what input i adds) in float32, bfloat16 or int8 with one scale per row. Biases (Qwen2's on
q/k/v) stay float32, one per output column."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sparse_engine.model.arch import UnsupportedModelError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}


@dataclass(frozen=True, slots=True)
class Matrix:
    """One or more projections of the same input, fused and stored input-major (in, out);
    `parts` names each one's columns. int8 weights carry one scale per row; `bias` is None
    when no part has one."""

    rows: torch.Tensor
    scale: torch.Tensor | None
    parts: tuple[tuple[str, int, int], ...]
    bias: torch.Tensor | None = None

    @classmethod
    def of(cls, modules: dict[str, Any], dtype: torch.dtype) -> Matrix:
        weights = [m.weight.detach().float() for m in modules.values()]
        rows = torch.cat(weights).T.contiguous()
        parts, start = [], 0
        for role, w in zip(modules, weights, strict=True):
            parts.append((role, start, start + w.shape[0]))
            start += w.shape[0]
        scale = None
        if dtype == torch.int8:
            scale = (rows.abs().amax(1) / 127).clamp_min(1e-12)
            rows = (rows / scale[:, None]).round().to(torch.int8)
        bias = None
        if any(getattr(m, "bias", None) is not None for m in modules.values()):
            bias = torch.cat(
                [
                    m.bias.detach().float() if m.bias is not None else w.new_zeros(w.shape[0])
                    for m, w in zip(modules.values(), weights, strict=True)
                ]
            ).contiguous()
        return cls(rows.to(dtype), scale, tuple(parts), bias)

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()

    def float_rows(self) -> torch.Tensor:
        rows = self.rows.float()
        return rows * self.scale[:, None] if self.scale is not None else rows


@dataclass(frozen=True, slots=True)
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: Matrix
    o: Matrix
    mlp_norm: torch.Tensor
    gate_up: Matrix
    down: Matrix


def matrices(layer: LayerWeights) -> tuple[Matrix, Matrix, Matrix, Matrix]:
    return layer.qkv, layer.o, layer.gate_up, layer.down


def extract_layer(layer: Any, dtype: torch.dtype) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    if any(m.bias is not None for m in (attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
        raise UnsupportedModelError("the fast path supports biases on q, k and v only")
    return LayerWeights(
        attn_norm=layer.input_layernorm.weight.detach(),
        qkv=Matrix.of({"q": attn.q_proj, "k": attn.k_proj, "v": attn.v_proj}, dtype),
        o=Matrix.of({"o": attn.o_proj}, dtype),
        mlp_norm=layer.post_attention_layernorm.weight.detach(),
        gate_up=Matrix.of({"gate": mlp.gate_proj, "up": mlp.up_proj}, dtype),
        down=Matrix.of({"down": mlp.down_proj}, dtype),
    )
