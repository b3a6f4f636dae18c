"""A lean decode path for Llama-family decoders: the weights are taken out of the Hugging Face
model once (q/k/v and gate/up fused), the KV cache is preallocated, and a token costs one
Python loop over the layers. Sparsity is the calibrated plan's threshold on the down
projection's input; with `sparse_rows` the down projection reads only the weight rows of the
kept activations. Signals are recorded exactly as the hooks record them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from sparse_engine.arch import UnsupportedModelError
from sparse_engine.loader import LoadedModel
from sparse_engine.plan import SparsityPlan
from sparse_engine.recorder import SignalRecorder


@dataclass(frozen=True, slots=True)
class _Layer:
    attn_norm: torch.Tensor
    qkv: torch.Tensor  # (q + k + v widths, hidden)
    o: torch.Tensor
    mlp_norm: torch.Tensor
    gate_up: torch.Tensor  # (2 * intermediate, hidden)
    down_rows: torch.Tensor  # (intermediate, hidden): row i is what activation i adds


class FastDecoder:
    """One sequence at a time. `prefill(ids)` then `step(token)`; both return the logits of
    the last position. Not thread-safe; `reset()` starts a new sequence."""

    def __init__(self, lm: LoadedModel, max_len: int = 2048, sparse_rows: bool = True) -> None:
        model: Any = lm.model
        cfg = model.config
        if getattr(cfg, "model_type", "") not in ("llama", "mistral", "qwen2"):
            raise UnsupportedModelError(
                f"the fast path supports Llama-family decoders, not {cfg.model_type!r}; "
                "the reference path serves it"
            )
        self.lm = lm
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.eps = cfg.rms_norm_eps
        self.max_len = max_len
        self.sparse_rows = sparse_rows
        self.layers = [_extract(layer) for layer in model.model.layers]
        self.embed = model.model.embed_tokens.weight.detach()
        self.norm = model.model.norm.weight.detach()
        self.head = model.lm_head.weight.detach()
        positions = torch.arange(max_len)[None]
        cos, sin = model.model.rotary_emb(self.embed[:1][None], positions)
        self.cos, self.sin = cos[0], sin[0]  # (max_len, head_dim)
        shape = (len(self.layers), self.kv_heads, max_len, self.head_dim)
        self.keys = torch.zeros(shape, dtype=self.embed.dtype)
        self.values = torch.zeros(shape, dtype=self.embed.dtype)
        self.length = 0
        self.rows_read = 0  # down-projection weight rows read by decode steps
        self.rows_total = 0  # and the rows a dense step reads

    @property
    def down_read_share(self) -> float:
        return self.rows_read / self.rows_total if self.rows_total else 1.0

    def weight_bytes(self, down_share: float = 1.0) -> float:
        """Weight bytes one decode step reads, with `down_share` of the down rows."""
        per_layer = sum(
            t.numel() * t.element_size()
            for layer in self.layers
            for t in (layer.qkv, layer.o, layer.gate_up)
        )
        down = sum(
            layer.down_rows.numel() * layer.down_rows.element_size() for layer in self.layers
        )
        return float(per_layer + down * down_share + self.head.numel() * self.head.element_size())

    def reset(self) -> None:
        self.length = 0

    def prefill(
        self, ids: list[int], plan: SparsityPlan, recorder: SignalRecorder | None = None
    ) -> torch.Tensor:
        return self._forward(torch.tensor(ids), plan, recorder)

    def step(
        self, token: int, plan: SparsityPlan, recorder: SignalRecorder | None = None
    ) -> torch.Tensor:
        return self._forward(torch.tensor([token]), plan, recorder)

    @torch.inference_mode()
    def _forward(
        self, ids: torch.Tensor, plan: SparsityPlan, recorder: SignalRecorder | None
    ) -> torch.Tensor:
        start, n = self.length, ids.shape[0]
        if start + n > self.max_len:
            raise ValueError(f"the sequence would exceed the fast path's {self.max_len} tokens")
        thresholds = plan.thresholds.get("down")
        if set(plan.thresholds) - {"down"} or plan.topk is not None:
            raise ValueError("the fast path runs threshold plans on the down projection only")
        if recorder is not None:
            recorder.begin_step()
        x = self.embed[ids]
        for i, layer in enumerate(self.layers):
            x = x + self._attention(i, layer, _rms(x, layer.attn_norm, self.eps), start)
            limit = thresholds[i] if thresholds is not None else None
            x = x + self._mlp(i, layer, _rms(x, layer.mlp_norm, self.eps), limit, recorder)
        self.length = start + n
        if recorder is not None:
            recorder.end_step()
        logits: torch.Tensor = _rms(x[-1], self.norm, self.eps) @ self.head.T
        return logits

    def _attention(self, i: int, layer: _Layer, h: torch.Tensor, start: int) -> torch.Tensor:
        n, hd = h.shape[0], self.head_dim
        widths = [self.heads * hd, self.kv_heads * hd, self.kv_heads * hd]
        q, k, v = torch.split(h @ layer.qkv.T, widths, dim=-1)
        cos, sin = self.cos[start : start + n], self.sin[start : start + n]
        q = _rope(q.view(n, self.heads, hd).transpose(0, 1), cos, sin)
        k = _rope(k.view(n, self.kv_heads, hd).transpose(0, 1), cos, sin)
        end = start + n
        self.keys[i, :, start:end] = k
        self.values[i, :, start:end] = v.view(n, self.kv_heads, hd).transpose(0, 1)
        out = F.scaled_dot_product_attention(
            q[None],
            self.keys[i, :, :end][None],
            self.values[i, :, :end][None],
            attn_mask=_causal(n, end) if n > 1 else None,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1).reshape(n, self.heads * hd) @ layer.o.T

    def _mlp(
        self,
        i: int,
        layer: _Layer,
        h: torch.Tensor,
        threshold: float | None,
        recorder: SignalRecorder | None,
    ) -> torch.Tensor:
        gate, up = (h @ layer.gate_up.T).chunk(2, dim=-1)
        a = F.silu(gate) * up
        magnitude = a.abs() if recorder is not None or threshold is not None else a
        if threshold is None:
            if recorder is not None:
                recorder.observe_channels(i, magnitude)
            self._count_rows(a, a.shape[-1])
            return a @ layer.down_rows
        kept = magnitude > threshold
        if recorder is not None:
            recorder.observe_sparsified(i, magnitude, kept)
            recorder.observe_channels(i, magnitude)
        if self.sparse_rows and a.shape[0] == 1:
            index = kept[0].nonzero().squeeze(1)
            self._count_rows(a, index.numel())
            return a[:, index] @ layer.down_rows.index_select(0, index)
        self._count_rows(a, a.shape[-1])
        return (a * kept) @ layer.down_rows

    def _count_rows(self, a: torch.Tensor, read: int) -> None:
        if a.shape[0] == 1:
            self.rows_read += read
            self.rows_total += a.shape[-1]


def _extract(layer: Any) -> _Layer:
    attn, mlp = layer.self_attn, layer.mlp
    if attn.q_proj.bias is not None or mlp.down_proj.bias is not None:
        raise UnsupportedModelError("the fast path supports projections without biases")
    return _Layer(
        attn_norm=layer.input_layernorm.weight.detach(),
        qkv=torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach(),
        o=attn.o_proj.weight.detach(),
        mlp_norm=layer.post_attention_layernorm.weight.detach(),
        gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach(),
        down_rows=mlp.down_proj.weight.detach().T.contiguous(),
    )


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _causal(n: int, end: int) -> torch.Tensor:
    """Boolean mask for n new positions ending at `end`: each sees the cache and itself."""
    return torch.ones(n, end, dtype=torch.bool).tril(diagonal=end - n)
