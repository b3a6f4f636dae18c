"""The fast path's weights: each decoder layer's projections taken out of the Hugging Face
model once, fused where they share an input (q/k/v, gate/up) and stored input-major (row i is
what input i adds) in float32, bfloat16 or int8 with one scale per row. Biases (Qwen2's on
q/k/v) stay float32, one per output column. Norm weights are stored as they multiply: Gemma's
`1 + w` is folded in, so one RMSNorm serves every family."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sparse_engine.model.arch import UnsupportedModelError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
LLAMA_LIKE = ("llama", "mistral", "qwen2")
GEMMA = ("gemma3_text",)


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
class Family:
    """What differs between the families the path runs, model-wide: the MLP's activation,
    the embedding's scale (Gemma multiplies by sqrt(hidden)), the attention logits' scale and
    the offset added to every norm weight (Gemma's `1 + w`)."""

    activation: str
    embed_scale: float
    attn_scale: float
    norm_offset: float

    @classmethod
    def of(cls, config: Any) -> Family:
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        if config.model_type in GEMMA:
            scale = torch.tensor(config.hidden_size**0.5, dtype=torch.float32)
            return cls(
                config.hidden_activation, float(scale), config.query_pre_attn_scalar**-0.5, 1.0
            )
        return cls(config.hidden_act, 1.0, head_dim**-0.5, 0.0)


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One decoder layer. `post_attn_norm` / `post_mlp_norm` normalise a block's output before
    the residual add, `q_norm` / `k_norm` each head before the rotation (Gemma 3); None where
    the family has none. `window` > 0 limits attention to that many latest positions, and
    `rope` picks the rotary table (Gemma's sliding layers rotate with their own base)."""

    attn_norm: torch.Tensor
    qkv: Matrix
    o: Matrix
    mlp_norm: torch.Tensor
    gate_up: Matrix
    down: Matrix
    post_attn_norm: torch.Tensor | None = None
    post_mlp_norm: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    window: int = 0
    rope: int = 0


def matrices(layer: LayerWeights) -> tuple[Matrix, Matrix, Matrix, Matrix]:
    return layer.qkv, layer.o, layer.gate_up, layer.down


def norm_weight(module: Any, offset: float) -> torch.Tensor:
    weight: torch.Tensor = module.weight.detach().float()
    return (weight + offset).contiguous()


def extract_layer(
    layer: Any, dtype: torch.dtype, family: Family, window: int = 0, rope: int = 0
) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    if any(m.bias is not None for m in (attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
        raise UnsupportedModelError("the fast path supports biases on q, k and v only")
    offset = family.norm_offset
    gemma = hasattr(layer, "pre_feedforward_layernorm")
    return LayerWeights(
        attn_norm=norm_weight(layer.input_layernorm, offset),
        qkv=Matrix.of({"q": attn.q_proj, "k": attn.k_proj, "v": attn.v_proj}, dtype),
        o=Matrix.of({"o": attn.o_proj}, dtype),
        mlp_norm=norm_weight(
            layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm, offset
        ),
        gate_up=Matrix.of({"gate": mlp.gate_proj, "up": mlp.up_proj}, dtype),
        down=Matrix.of({"down": mlp.down_proj}, dtype),
        post_attn_norm=norm_weight(layer.post_attention_layernorm, offset) if gemma else None,
        post_mlp_norm=norm_weight(layer.post_feedforward_layernorm, offset) if gemma else None,
        q_norm=norm_weight(attn.q_norm, offset) if hasattr(attn, "q_norm") else None,
        k_norm=norm_weight(attn.k_norm, offset) if hasattr(attn, "k_norm") else None,
        window=window,
        rope=rope,
    )
