"""A lean decode path for Llama-family decoders (Llama, Mistral, Qwen2 with its q/k/v biases) and
Gemma 3 (scaled embeddings, `1 + w` norms, q/k norms, norms after each block, GELU-tanh,
sliding-window layers with their own rotary base). The weights are taken out of the Hugging
Face model once, stored input-major (row i of a projection is what its input i adds) in
float32, bfloat16 or int8, with q/k/v and gate/up fused; the KV cache is preallocated. A
calibrated plan's thresholds on projection inputs (any of q, k, v, o, gate, up, down) decide
which weight rows a decode step reads. With the compiled module (`runtime.kernels`) a decode
step is one call that runs every layer and reads only the rows of kept activations; without it,
one Python loop over the layers with a PyTorch row gather. A prefill is the masked dense
product, as the hooks compute it, position 0 (the attention sink) unmasked as there. Signals
are recorded as the hooks record them, summed per layer and handed to the recorder once per
step. Another family (or logit soft-capping) is refused: the engine says so at start and serves
it on the reference path."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

from sparse_engine.model.arch import UnsupportedModelError
from sparse_engine.model.loader import LoadedModel
from sparse_engine.runtime.fast_weights import (
    DTYPES,
    Family,
    LayerWeights,
    Matrix,
    extract_layer,
    layer_types,
    matrices,
    norm_weight,
    rotary_table,
    sliding_window,
    unsupported_reason,
)
from sparse_engine.runtime.kernels import torch_rows_matvec
from sparse_engine.sparsity import signals
from sparse_engine.sparsity.plan import SparsityPlan
from sparse_engine.sparsity.readout import Readout
from sparse_engine.sparsity.recorder import LayerCounts, SignalRecorder

ROLES = ("q", "k", "v", "o", "gate", "up", "down")


class FastDecoder:
    """One sequence at a time. `prefill(ids)` then `step(token)`; both return the logits of
    the last position. Not thread-safe; `reset()` starts a new sequence. `native` is the
    compiled module (`sparse_engine.runtime.kernels.load`); None runs the PyTorch fallback."""

    def __init__(
        self, lm: LoadedModel, max_len: int = 2048, dtype: str = "float32", native: Any = None
    ) -> None:
        model: Any = lm.model
        cfg = model.config
        refusal = unsupported_reason(lm)
        if refusal is not None:
            raise UnsupportedModelError(refusal)
        if dtype not in DTYPES:
            raise ValueError(f"unknown weight type {dtype!r}; choose one of {', '.join(DTYPES)}")
        self.lm = lm
        self.dtype = dtype
        self.native = native
        self.kernel = native.rows_matvec if native is not None else torch_rows_matvec
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.eps = cfg.rms_norm_eps
        self.max_len = max_len
        self.family = Family.of(cfg)
        types = layer_types(model)
        tables = sorted(set(types))
        self.layers = [
            extract_layer(
                layer, DTYPES[dtype], self.family, sliding_window(cfg, kind), tables.index(kind)
            )
            for layer, kind in zip(model.model.layers, types, strict=True)
        ]
        self.embed = model.model.embed_tokens.weight.detach()
        self.norm = norm_weight(model.model.norm, self.family.norm_offset)
        self.head = Matrix.of({"head": model.lm_head}, DTYPES[dtype])
        self.device = self.embed.device  # the PyTorch fallback runs wherever the model is
        # Rotary tables, one per layer type: (max_len, tables, head_dim).
        cos, sin = zip(*(rotary_table(model, kind, max_len) for kind in tables), strict=True)
        self.cos = torch.stack(cos, 1).contiguous()
        self.sin = torch.stack(sin, 1).contiguous()
        shape = (len(self.layers), self.kv_heads, max_len, self.head_dim)
        self.keys = torch.zeros(shape, dtype=self.embed.dtype, device=self.device)
        self.values = torch.zeros(shape, dtype=self.embed.dtype, device=self.device)
        self._own = (self.keys, self.values)
        widths = {layer.down.rows.shape[0] for layer in self.layers}
        if len(widths) > 1:
            raise UnsupportedModelError("the fast path needs one MLP width in every layer")
        self.channels = torch.zeros(len(self.layers), widths.pop(), device=self.device)
        self.counts = torch.zeros(len(self.layers), 5, dtype=torch.float64)  # see Layers.step
        # The trust readout of a step (see Layers.step), and the empty pair that turns it off.
        width = self.embed.shape[1]
        self.hidden_rows = torch.zeros(len(self.layers), width)
        self.attention_rows = torch.zeros(len(self.layers), self.heads, 2, dtype=torch.float64)
        self._unread = (torch.empty(0), torch.empty(0, dtype=torch.float64))
        self.dense_weights = float(sum(m.rows.numel() for m in matrices(self.layers[0])))
        self._limits: tuple[SparsityPlan, torch.Tensor] | None = None
        self.tokens: list[int] = []  # the sequence in the KV cache
        self.length = 0
        self.weights_read = 0.0  # projection weights read by decode steps
        self.weights_total = 0.0  # and those dense steps would read
        if native is not None:
            if self.device.type != "cpu":
                raise ValueError("the compiled kernels run on the CPU; pass native=None")
            gelu = self.family.activation != "silu"
            self._layers = native.Layers(
                self.heads, self.kv_heads, self.head_dim, self.eps, self.family.attn_scale, gelu
            )
            for layer in self.layers:
                mats = [native.Matrix(m.rows, m.scale, m.bias) for m in matrices(layer)]
                self._layers.add(_norms(layer), mats, layer.window, layer.rope)

    @property
    def read_share(self) -> float:
        """Share of the projections' weights the decode steps read."""
        return self.weights_read / self.weights_total if self.weights_total else 1.0

    def weight_bytes(self, read_share: float = 1.0) -> float:
        """Weight bytes one decode step reads, with `read_share` of the projection rows."""
        projections = sum(m.nbytes for layer in self.layers for m in matrices(layer))
        return float(projections * read_share + self.head.nbytes)

    def reset(self) -> None:
        self.length = 0
        self.tokens = []

    def bind(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """Run on another KV cache (a scheduler's slot, `runtime.batch`), whose first `length`
        positions hold the sequence so far; each layer's block is contiguous. `unbind` goes
        back to its own."""
        self.keys, self.values, self.length = keys, values, length

    def unbind(self) -> None:
        self.keys, self.values = self._own
        self.reset()

    def supports(self, plan: SparsityPlan, tokens: int) -> bool:
        """Whether this path can run `plan` over a sequence of `tokens`."""
        return (
            not set(plan.thresholds) - set(ROLES)
            and plan.topk is None
            and plan.gates is None
            and tokens <= self.max_len
        )

    def prefill(
        self,
        ids: list[int],
        plan: SparsityPlan,
        recorder: SignalRecorder | None = None,
        readout: Readout | None = None,
    ) -> torch.Tensor:
        return self._forward(torch.tensor(ids, device=self.device), plan, recorder, readout)

    @torch.inference_mode()
    def step(
        self,
        token: int,
        plan: SparsityPlan,
        recorder: SignalRecorder | None = None,
        readout: Readout | None = None,
    ) -> torch.Tensor:
        if self.native is None or self.length == 0:  # position 0 is a prefill's, dense
            ids = torch.tensor([token], device=self.device)
            return self._forward(ids, plan, recorder, readout)
        pos = self.length
        if pos >= self.max_len:
            raise ValueError(f"the sequence would exceed the fast path's {self.max_len} tokens")
        limits = self._thresholds(plan)
        x = self._embed(torch.tensor([token]))[0]
        reading = readout is not None and readout.wants(pos, 1)
        rows = (self.hidden_rows, self.attention_rows) if reading else self._unread
        prompt_len = readout.prompt_len if readout is not None else 0
        self._layers.step(
            x, self.keys, self.values, self.cos[pos], self.sin[pos], pos, limits,
            self.channels, self.counts, *rows, prompt_len,
        )  # fmt: skip
        if reading and readout is not None:
            readout.observe_step(self.hidden_rows, self.attention_rows, pos)
        self.length = pos + 1
        self.tokens.append(token)
        self.weights_read += float(self.counts[:, 4].sum())
        self.weights_total += self.dense_weights * len(self.layers)
        if recorder is not None:
            recorder.begin_step()
            recorder.observe_layers(self.counts[:, :4], self.channels, 1)
            recorder.end_step()
        h = self._norm(x, self.norm)
        logits: torch.Tensor = self.kernel(h, self.head.rows, self.head.scale, -1.0)[0]
        return logits

    def _thresholds(self, plan: SparsityPlan) -> torch.Tensor:
        """The plan as a (layers, roles) float64 table, -1 where a role is dense."""
        self._check(plan)
        if self._limits is None or self._limits[0] is not plan:
            table = torch.full((len(self.layers), len(ROLES)), -1.0, dtype=torch.float64)
            for role, per_layer in plan.thresholds.items():
                table[:, ROLES.index(role)] = torch.tensor(per_layer, dtype=torch.float64)
            self._limits = (plan, table)
        return self._limits[1]

    @staticmethod
    def _check(plan: SparsityPlan) -> None:
        if set(plan.thresholds) - set(ROLES) or plan.topk is not None or plan.gates is not None:
            raise ValueError(
                f"the fast path runs threshold plans on {', '.join(ROLES)}; the reference "
                "path serves Top-K, learned gates and other roles"
            )

    @torch.inference_mode()
    def _forward(
        self,
        ids: torch.Tensor,
        plan: SparsityPlan,
        recorder: SignalRecorder | None,
        readout: Readout | None = None,
    ) -> torch.Tensor:
        start, n = self.length, ids.shape[0]
        if start + n > self.max_len:
            raise ValueError(f"the sequence would exceed the fast path's {self.max_len} tokens")
        self._check(plan)
        counts = LayerCounts.empty(len(self.layers)) if recorder is not None else None
        sink = start == 0
        x = self._embed(ids)
        for i, layer in enumerate(self.layers):
            limits = {role: t[i] for role, t in plan.thresholds.items()}
            h = self._norm(x, layer.attn_norm)
            qkv = self._project(i, layer.qkv, h, limits, counts, sink)
            attn = self._attention(i, qkv, start, readout)
            o = self._project(i, layer.o, attn, limits, counts, sink)
            x = x + self._norm(o, layer.post_attn_norm)
            h = self._norm(x, layer.mlp_norm)
            gate, up = self._project(i, layer.gate_up, h, limits, counts, sink).chunk(2, dim=-1)
            a = self._activation(gate) * up
            if recorder is not None:
                torch.sum(a.abs(), 0, out=self.channels[i])
            down = self._project(i, layer.down, a, limits, counts, sink)
            x = x + self._norm(down, layer.post_mlp_norm)
            if readout is not None and readout.wants(start, n):
                readout.observe_hidden(i, x, start)
        self.length = start + n
        self.tokens.extend(ids.tolist())
        if recorder is not None and counts is not None:
            recorder.begin_step()
            recorder.observe_layers(counts.tensor(), self.channels, n)
            recorder.end_step()
        h = self._norm(x[-1:], self.norm)
        return self._project(-1, self.head, h, {}, None)[0]

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        x: torch.Tensor = self.embed[ids.to(self.device)]
        return x * self.family.embed_scale if self.family.embed_scale != 1.0 else x.clone()

    def _norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        return x if weight is None else F.rms_norm(x, weight.shape, weight, self.eps)

    def _activation(self, gate: torch.Tensor) -> torch.Tensor:
        if self.family.activation == "silu":
            return F.silu(gate)
        return F.gelu(gate, approximate="tanh")

    def _project(
        self,
        i: int,
        m: Matrix,
        x: torch.Tensor,
        limits: dict[str, float],
        counts: LayerCounts | None,
        sink: bool = False,
    ) -> torch.Tensor:
        """x (n, in) through the fused matrix, each part at its role's threshold; with `sink`,
        the first row (position 0) unmasked."""
        width = x.shape[-1]
        if len({limits.get(role) for role, _, _ in m.parts}) == 1:  # one product for all parts
            groups = [(limits.get(m.parts[0][0]), 0, m.parts[-1][2], len(m.parts))]
        else:
            groups = [(limits.get(role), begin, end, 1) for role, begin, end in m.parts]
        if x.shape[0] > 1:
            return self._project_many(i, m, x, groups, counts, sink)
        outputs = []
        for limit, begin, end, parts in groups:
            y, kept, kept_abs, total_abs = self.kernel(
                x[0], m.rows, m.scale, -1.0 if limit is None or sink else limit, begin, end
            )
            outputs.append(y if m.bias is None else y + m.bias[begin:end])
            if i >= 0:
                self.weights_read += kept * (end - begin)
                self.weights_total += width * (end - begin)
            if limit is not None and counts is not None:
                share = kept_abs / total_abs if total_abs > 0 else 1.0
                for _ in range(parts):  # the hooks see each part's input on its own
                    counts.add(i, width, kept, share, 1)
        return (outputs[0] if len(outputs) == 1 else torch.cat(outputs))[None]

    def _project_many(
        self,
        i: int,
        m: Matrix,
        x: torch.Tensor,
        groups: list[tuple[float | None, int, int, int]],
        counts: LayerCounts | None,
        sink: bool,
    ) -> torch.Tensor:
        """A prefill: the masked dense product, as the hooks compute it."""
        outputs = []
        for limit, begin, end, parts in groups:
            if limit is None:
                outputs.append(m.product(x, begin, end))
                continue
            magnitude = x.abs()
            kept = magnitude > limit
            if sink:
                kept[0] = True
            outputs.append(m.product(x * kept, begin, end))
            if counts is not None:
                share = float(signals.kept_magnitude_share(magnitude, kept).sum())
                for _ in range(parts):
                    counts.add(i, x.numel(), int(kept.sum()), share, x.shape[0])
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)

    def _attention(
        self, i: int, qkv: torch.Tensor, start: int, readout: Readout | None = None
    ) -> torch.Tensor:
        n, hd, layer = qkv.shape[0], self.head_dim, self.layers[i]
        widths = [self.heads * hd, self.kv_heads * hd, self.kv_heads * hd]
        q, k, v = torch.split(qkv, widths, dim=-1)
        cos = self.cos[start : start + n, layer.rope]
        sin = self.sin[start : start + n, layer.rope]
        q = self._norm(q.view(n, self.heads, hd), layer.q_norm)
        k = self._norm(k.view(n, self.kv_heads, hd), layer.k_norm)
        q = _rope(q.transpose(0, 1), cos, sin)
        k = _rope(k.transpose(0, 1), cos, sin)
        end = start + n
        self.keys[i, :, start:end] = k
        self.values[i, :, start:end] = v.view(n, self.kv_heads, hd).transpose(0, 1)
        mask = _visible(n, end, layer.window, self.device)
        if readout is not None and readout.wants(start, n):
            skip = max(0, readout.prompt_len - 1 - start)  # the prompt's own queries
            rows = mask[skip:] if mask is not None else None
            probs = self._probabilities(i, q[:, skip:], end, rows)
            readout.observe_attention(i, probs, start + skip)
        out = F.scaled_dot_product_attention(
            q[None],
            self.keys[i, :, :end][None],
            self.values[i, :, :end][None],
            attn_mask=mask,
            scale=self.family.attn_scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1).reshape(n, self.heads * hd)

    def _probabilities(
        self, i: int, q: torch.Tensor, end: int, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Attention probabilities (heads, n, end) of the queries q (heads, n, head_dim), which
        SDPA does not return; only for calls that hold an answer's queries."""
        keys = self.keys[i, :, :end].repeat_interleave(self.heads // self.kv_heads, 0)
        scores = (q @ keys.transpose(-1, -2)) * self.family.attn_scale
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return scores.softmax(-1)


def _norms(layer: LayerWeights) -> list[torch.Tensor]:
    """The compiled layer's norms in its order; an empty tensor where the family has none."""
    none = torch.empty(0)
    optional = (layer.post_attn_norm, layer.post_mlp_norm, layer.q_norm, layer.k_norm)
    return [layer.attn_norm, layer.mlp_norm, *(none if w is None else w for w in optional)]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _visible(n: int, end: int, window: int, device: torch.device) -> torch.Tensor | None:
    """Boolean mask for n new positions ending at `end`: each sees the cache and itself, or
    only the last `window` positions up to itself; None when every position is visible."""
    if n == 1 and (window == 0 or end <= window):
        return None
    query = torch.arange(end - n, end, device=device)[:, None]
    key = torch.arange(end, device=device)[None]
    seen = key <= query
    return seen & (key > query - window) if window else seen
