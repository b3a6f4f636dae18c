"""Many sequences' decode steps as one: the fast path's weights read once for a batch of rows,
each row at its own position, under its own thresholds (rows of different levels share a
batch), into its own KV slot, with its own signals and readout.

KV slots: one (layers, slots, kv heads, max_len, head dim) cache per engine, taken from the
allocator unwritten and zeroed only as far as a step reads, so memory grows with the tokens
sequences reach, not with `slots x max_len`. The rows of a batched step are slots 0 .. B-1
(the scheduler keeps its sequences packed), so each layer's keys are one view. With the
compiled kernels each row attends over its own positions in its slot, with the code a row alone
runs (`Layers.attend_rows`); without them, as one padded product with a per-row visibility
mask (the padding must hold finite numbers: a masked probability of 0 times a NaN left in
unwritten memory is still NaN).

Which product: a row alone reads only its kept weight rows (the compiled kernel); B rows
together read every weight row once and zero each row's dropped inputs (`x * kept @ W`), the
hooks' computation. Per-row thresholds cost nothing there: the mask is elementwise anyway.
`sparseguard bench batch-step` measures both for each batch size. bfloat16 weights batch where
the processor multiplies bfloat16 (AMX, AVX-512 BF16); both ways then round each product's
input and result to bfloat16, so a row batched and alone get the same numbers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparse_engine.runtime.fast_weights import BF16_PRODUCTS, Matrix
from sparse_engine.runtime.fastpath import ROLES, FastDecoder, _rope
from sparse_engine.sparsity import signals
from sparse_engine.sparsity.readout import Readout
from sparse_engine.sparsity.recorder import SignalRecorder


@dataclass(slots=True)
class Row:
    """One sequence's next decode step: feed `token` at position `pos` of slot `slot`."""

    slot: int
    pos: int
    token: int
    limits: torch.Tensor  # (layers, roles) float64, -1 where the role is dense
    recorder: SignalRecorder | None
    readout: Readout | None


class KVSlots:
    """The scheduler's KV cache: `slots` sequences of up to the fast path's `max_len`."""

    def __init__(self, fast: FastDecoder, slots: int) -> None:
        shape = (len(fast.layers), slots, fast.kv_heads, fast.max_len, fast.head_dim)
        self.keys = torch.empty(shape, dtype=fast.embed.dtype, device=fast.device)
        self.values = torch.empty(shape, dtype=fast.embed.dtype, device=fast.device)
        self.fast = fast
        self.clean = [0] * slots  # per slot, the positions holding finite numbers

    def readable(self, lengths: list[int], end: int) -> None:
        """Make positions 0 .. end-1 of slots 0 .. len(lengths)-1 safe to read: each slot's
        sequence holds its first `lengths[slot]`; zero what no sequence has written after."""
        for slot, length in enumerate(lengths):
            start = max(self.clean[slot], length)
            if start < end:
                self.keys[:, slot, :, start:end] = 0
                self.values[:, slot, :, start:end] = 0
            self.clean[slot] = max(self.clean[slot], end)

    def bind(self, slot: int, length: int) -> FastDecoder:
        """The fast decoder, running on `slot` whose first `length` positions are filled."""
        self.fast.bind(self.keys[:, slot], self.values[:, slot], length)
        return self.fast

    def move(self, source: int, target: int, length: int) -> None:
        """Copy a sequence's first `length` positions to another slot (packing the batch)."""
        self.keys[:, target, :, :length] = self.keys[:, source, :, :length]
        self.values[:, target, :, :length] = self.values[:, source, :, :length]


class BatchStep:
    """The batched decode step over a fast decoder's float32 weights, or bfloat16 ones where
    the processor multiplies bfloat16 (`fast_weights.BF16_PRODUCTS`), and a slot cache."""

    def __init__(self, slots: KVSlots) -> None:
        self.fast, self.kv = slots.fast, slots
        if not self.runs(self.fast.dtype):
            raise ValueError(f"the batched step does not multiply {self.fast.dtype} weights here")

    @staticmethod
    def runs(dtype: str) -> bool:
        """Whether a batched step multiplies `dtype` weights on this processor."""
        return dtype == "float32" or (dtype == "bfloat16" and BF16_PRODUCTS)

    @torch.inference_mode()
    def __call__(self, rows: list[Row]) -> torch.Tensor:
        """Logits (B, vocab) of rows whose slots are 0 .. B-1, in order."""
        fast, n = self.fast, len(rows)
        if [r.slot for r in rows] != list(range(n)):
            raise ValueError("a batched step runs the packed slots 0 .. B-1 in order")
        pos = torch.tensor([r.pos for r in rows])
        x = fast._embed(torch.tensor([r.token for r in rows], device=fast.device))
        limits = torch.stack([r.limits for r in rows]).to(torch.float32)  # (B, layers, roles)
        sparse = (limits >= 0).any(0).tolist()  # per layer and role: does any row sparsify it
        layers = len(fast.layers)
        tally = _Tally()
        channels = torch.zeros(n, layers, fast.channels.shape[1])
        reading = [r.readout is not None and r.readout.wants(r.pos, 1) for r in rows]
        hidden = torch.zeros(n, layers, x.shape[1]) if any(reading) else None
        attention = torch.zeros(n, layers, fast.heads, 2, dtype=torch.float64)
        prompt = torch.tensor([r.readout.prompt_len if r.readout else 0 for r in rows])
        end = int(pos.max()) + 1
        self.kv.readable([r.pos for r in rows], end)
        at = _Positions.of(fast, pos, end, prompt, any(reading))
        for i, layer in enumerate(fast.layers):
            lim = limits[:, i]
            h = fast._norm(x, layer.attn_norm)
            qkv = _project(layer.qkv, h, lim, sparse[i], tally, i)
            att = self._attend(i, qkv, at, attention[:, i])
            o = _project(layer.o, att, lim, sparse[i], tally, i)
            x = x + fast._norm(o, layer.post_attn_norm)
            h = fast._norm(x, layer.mlp_norm)
            gate, up = _project(layer.gate_up, h, lim, sparse[i], tally, i).chunk(2, dim=-1)
            a = fast._activation(gate) * up
            channels[:, i] = a.abs()
            down = _project(layer.down, a, lim, sparse[i], tally, i)
            x = x + fast._norm(down, layer.post_mlp_norm)
            if hidden is not None:
                hidden[:, i] = x
        counts = tally.counts(n, layers)
        for b, row in enumerate(rows):
            if row.recorder is not None:
                row.recorder.begin_step()
                row.recorder.observe_layers(counts[b], channels[b], 1)
                row.recorder.end_step()
            if reading[b] and row.readout is not None and hidden is not None:
                row.readout.observe_step(hidden[b], attention[b], row.pos)
        h = fast._norm(x, fast.norm)
        return fast.head.product(h)

    def _attend(
        self, i: int, qkv: torch.Tensor, at: _Positions, stats: torch.Tensor
    ) -> torch.Tensor:
        """Each row's query over its own slot's positions 0 .. pos (or its window), padded to
        the longest row; writes each head's attention share on the prompt and entropy when a
        row reads them."""
        fast, layer = self.fast, self.fast.layers[i]
        n, hd, kv = qkv.shape[0], fast.head_dim, fast.kv_heads
        if fast.native is not None:  # each row over its own positions, as a row alone attends
            out = torch.empty(n, fast.heads * hd)
            read = torch.empty(n, fast.heads, 2, dtype=torch.float64) if at.reads else _NONE
            fast._layers.attend_rows(
                i, qkv.contiguous(), self.kv.keys[i], self.kv.values[i], *at.tables,
                at.pos, at.prompt, out, read,
            )  # fmt: skip
            if at.reads:
                stats.copy_(read)
            return out
        q, k, v = torch.split(qkv, [fast.heads * hd, kv * hd, kv * hd], dim=-1)
        cos, sin = at.rope[layer.rope]
        q = _rope(fast._norm(q.view(n, fast.heads, hd), layer.q_norm), cos, sin)
        k = _rope(fast._norm(k.view(n, kv, hd), layer.k_norm), cos, sin)
        keys, values = self.kv.keys[i, :n], self.kv.values[i, :n]
        keys[at.rows, :, at.pos] = k
        values[at.rows, :, at.pos] = v.view(n, kv, hd)
        q = q.view(n, kv, fast.heads // kv, hd) * fast.family.attn_scale
        scores = q @ keys[:, :, : at.end].transpose(-1, -2)
        probs = scores.masked_fill_(at.hidden(layer.window), float("-inf")).softmax(-1)
        out = probs @ values[:, :, : at.end]  # (B, kv, group, hd)
        if at.on_prompt is not None:
            stats[..., 0] = (probs * at.on_prompt).sum(-1).reshape(n, fast.heads)
            entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
            stats[..., 1] = entropy.reshape(n, fast.heads)
        return out.reshape(n, fast.heads * hd)


_NONE = torch.empty(0, dtype=torch.float64)


@dataclass(slots=True)
class _Positions:
    """What every layer of one batched step shares: the rows' positions, the rotary tables
    there, the masks of the keys each row cannot see (per window size) and, when a row reads
    the trust readout, of its prompt's keys."""

    rows: torch.Tensor
    pos: torch.Tensor
    end: int
    rope: list[tuple[torch.Tensor, torch.Tensor]]
    on_prompt: torch.Tensor | None
    prompt: torch.Tensor  # (B,) int64: each row's prompt length (0 where it reads nothing)
    tables: tuple[torch.Tensor, torch.Tensor]  # cos, sin (B, tables, head dim) at each row
    _hidden: dict[int, torch.Tensor]

    @classmethod
    def of(
        cls, fast: FastDecoder, pos: torch.Tensor, end: int, prompt: torch.Tensor, reads: bool
    ) -> _Positions:
        key = torch.arange(end)[None]
        tables = (fast.cos[pos].contiguous(), fast.sin[pos].contiguous())
        rope = [(tables[0][:, t, None], tables[1][:, t, None]) for t in range(fast.cos.shape[1])]
        on_prompt = (key < prompt[:, None])[:, None, None] if reads else None
        return cls(torch.arange(len(pos)), pos, end, rope, on_prompt, prompt, tables, {})

    @property
    def reads(self) -> bool:
        return self.on_prompt is not None

    def hidden(self, window: int) -> torch.Tensor:
        """(B, 1, 1, end) True where a row's query cannot see the key."""
        mask = self._hidden.get(window)
        if mask is None:
            key = torch.arange(self.end)[None]
            seen = key <= self.pos[:, None]
            if window:
                seen &= key > self.pos[:, None] - window
            mask = self._hidden[window] = (~seen)[:, None, None]
        return mask


def _project(
    m: Matrix, x: torch.Tensor, limits: torch.Tensor, sparse: list[bool], tally: _Tally, layer: int
) -> torch.Tensor:
    """x (B, in) through the fused matrix, each part at each row's threshold for its role
    (limits (B, roles), negative: dense; `sparse`: per role, whether any row sparsifies it),
    each sparse product's sums into `tally`."""
    if not any(sparse[ROLES.index(role)] for role, _, _ in m.parts):
        return m.product(x)  # every row dense here: nothing to mask or count
    per_part = limits[:, [ROLES.index(role) for role, _, _ in m.parts]]  # (B, parts)
    if bool((per_part == per_part[:, :1]).all()):
        groups = [(per_part[:, 0], 0, m.parts[-1][2], len(m.parts))]
    else:
        groups = [(per_part[:, j], b, e, 1) for j, (_, b, e) in enumerate(m.parts)]
    outputs = []
    for limit, begin, end, parts in groups:
        on = limit >= 0
        if not bool(on.any()):
            outputs.append(m.product(x, begin, end))
            continue
        magnitude = x.abs()
        kept = magnitude > limit[:, None]
        masked = x * kept
        tally.add(layer, on * parts, kept, magnitude, masked)
        outputs.append(m.product(masked, begin, end))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)


class _Tally:
    """Each row's signal counts of one step, as the hooks count them (per layer: zeroed,
    total, kept-magnitude share, tokens; once per part): each sparse product's sums are kept
    as they come and combined in one pass at the end of the step."""

    def __init__(self) -> None:
        self.layers: list[int] = []
        self.weights: list[torch.Tensor] = []  # (B,): parts counted where the row is sparse
        self.sums: list[torch.Tensor] = []  # (3, B): kept inputs, sum |x|, sum |kept x|
        self.widths: list[int] = []

    def add(
        self,
        layer: int,
        weight: torch.Tensor,
        kept: torch.Tensor,
        magnitude: torch.Tensor,
        masked: torch.Tensor,
    ) -> None:
        self.layers.append(layer)
        self.weights.append(weight.double())
        self.widths.append(kept.shape[-1])
        sums = [kept.sum(-1, dtype=magnitude.dtype), magnitude.sum(-1), masked.abs().sum(-1)]
        self.sums.append(torch.stack(sums))

    def counts(self, rows: int, layers: int) -> torch.Tensor:
        """(rows, layers, 4) float64."""
        counts = torch.zeros(rows, layers, 4, dtype=torch.float64)
        if not self.layers:
            return counts
        kept, total, kept_abs = torch.stack(self.sums).unbind(1)  # (K, B) each
        share = signals.kept_share(kept_abs, total).double()
        on = torch.stack(self.weights)
        width = torch.tensor(self.widths, dtype=torch.float64)[:, None]
        values = torch.stack([on * (width - kept.double()), on * width, on * share, on], -1)
        return counts.index_add_(1, torch.tensor(self.layers), values.transpose(0, 1))
