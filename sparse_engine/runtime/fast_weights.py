"""The fast path's weights: each decoder layer's projections taken out of the Hugging Face
model once, fused where they share an input (q/k/v, gate/up) and stored input-major (row i is
what input i adds) in float32, bfloat16 or int8 with one scale per row. Biases (Qwen2's on
q/k/v) stay float32, one per output column. Norm weights are stored as they multiply: Gemma's
`1 + w` is folded in, so one RMSNorm serves every family. Also what the path reads off the
model's config: whether it can run the family, each layer's attention type and window, and
the rotary tables."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from sparse_engine.model.arch import UnsupportedModelError
from sparse_engine.model.loader import LoadedModel
from sparse_engine.runtime.kernels import weight_product

ONEDNN = bool(torch.backends.mkldnn.is_available()) and hasattr(  # type: ignore[no-untyped-call]
    torch.ops.mkldnn, "_linear_pointwise"
)
# Whether oneDNN multiplies bfloat16 natively here (AVX-512 BF16 or AMX): then bfloat16
# weights multiply many rows as bfloat16 products, 3-8x faster than float32 for 16-1024 rows
# on an AMX processor; elsewhere they are widened to float32 first. Either way, and in the row
# kernel, a bfloat16 product rounds its input and its result to bfloat16 (float32 sums).
BF16_PRODUCTS = ONEDNN and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
PACK_ROWS = 16  # the row count oneDNN lays the blocked copy out for (a batched step's)
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
    # The same weights in oneDNN's blocked layout, for products of many rows (prefills,
    # batched steps): float32, or bfloat16 where BF16_PRODUCTS; the row kernel reads `rows`.
    packed: torch.Tensor | None = None

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
        rows = rows.to(dtype)
        packed = None
        if rows.device.type == "cpu" and (
            (dtype == torch.float32 and ONEDNN) or (dtype == torch.bfloat16 and BF16_PRODUCTS)
        ):
            packed = torch.ops.mkldnn._reorder_linear_weight(rows.T.contiguous(), PACK_ROWS)
        return cls(rows, scale, tuple(parts), bias, packed)

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()

    def product(self, x: torch.Tensor, begin: int = 0, end: int | None = None) -> torch.Tensor:
        """x (n, in) through columns begin:end, with their bias: several rows at once (a
        prefill, a batched step). float32 goes through oneDNN where PyTorch has it, which
        multiplied 2-3x faster than PyTorch's default BLAS on an AMD processor for 4 to 200
        rows (`sparseguard bench batch-step`), from its blocked copy for the whole matrix
        (1.1-2.6x faster again than the row view, and 2.6x for the 49152-column head: the
        same numbers to float rounding), else from the row view as is. bfloat16 multiplies as
        bfloat16 where the processor does (`BF16_PRODUCTS`), rounding input and sums to bfloat16
        as the row kernel does; the result is float32."""
        end = self.rows.shape[1] if end is None else end
        bias = self.bias[begin:end] if self.bias is not None else None
        whole = begin == 0 and end == self.rows.shape[1]
        if self.rows.dtype == torch.bfloat16 and BF16_PRODUCTS and x.device.type == "cpu":
            xb = x.to(torch.bfloat16)
            y: torch.Tensor
            if self.packed is not None and whole:
                y = torch.ops.mkldnn._linear_pointwise(xb, self.packed, None, "none", [], "")
            else:
                y = xb @ self.rows[:, begin:end]
            return y.float() if bias is None else y.float() + bias
        if self.packed is not None and whole:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")  # type: ignore[no-any-return]
        if self.rows.dtype == torch.float32 and ONEDNN and x.device.type == "cpu":
            w = self.rows[:, begin:end].t()
            return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")  # type: ignore[no-any-return]
        if self.rows.dtype == torch.bfloat16:  # rounded as a bfloat16 product rounds
            y = weight_product(x, self.rows[:, begin:end])
        else:
            y = x @ self.float_rows()[:, begin:end]
        return y if bias is None else y + bias

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


def unsupported_reason(lm: LoadedModel) -> str | None:
    """Why the fast path cannot run this model's family, or None (checked before any weight
    is copied; a layer the path cannot run is refused when the weights are taken out)."""
    cfg = lm.model.config
    model_type = getattr(cfg, "model_type", "")
    if model_type not in LLAMA_LIKE + GEMMA:
        return (
            f"the fast path supports Llama-family and Gemma 3 decoders, not {model_type!r}; "
            "the reference path serves it"
        )
    activation = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
    if activation not in ACTIVATIONS:
        return f"the fast path's MLP runs {' or '.join(ACTIVATIONS)}, not {activation!r}"
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, cap, None) is not None:
            return f"the fast path does not soft-cap logits ({cap} is set)"
    return None


def layer_types(model: Any) -> list[str]:
    """Each layer's attention type; one type when the model's rotary table has no per-type
    variant (Llama, Qwen2: its sliding layers rotate as the others do)."""
    cfg = model.config
    types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers)
    if "layer_type" not in inspect.signature(model.model.rotary_emb.forward).parameters:
        return types if "sliding_attention" in types else ["full_attention"] * len(types)
    return types


def sliding_window(cfg: Any, kind: str) -> int:
    return int(cfg.sliding_window) if kind == "sliding_attention" and cfg.sliding_window else 0


def rotary_table(model: Any, kind: str, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (max_len, head_dim) of the rotary table layers of `kind` use."""
    rotary = model.model.rotary_emb
    x = model.model.embed_tokens.weight[:1][None]
    positions = torch.arange(max_len, device=x.device)[None]
    takes_type = "layer_type" in inspect.signature(rotary.forward).parameters
    cos, sin = rotary(x, positions, kind) if takes_type else rotary(x, positions)
    return cos[0], sin[0]
