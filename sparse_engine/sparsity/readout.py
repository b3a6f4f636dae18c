"""What the trust model reads off an answer's forward passes besides the sparsity signals: the
residual stream at a few mid-upper layers (at the last prompt token, the first answer token and
averaged over the answer) and, per attention head, the share of each answer query's attention
that falls on the prompt rather than on the answer so far (Lookback Lens' ratio) and the
attention's entropy. Filled by whichever path runs the passes (the Hugging Face hooks of
`sparsity.hooks.read_out`, or the fast path), one forward call at a time, by position.

Positions: the prompt is 0 .. P-1, the answer P .. P+m-1. The query at P-1+j predicts answer
token j, so attention is read at query positions P-1 .. P+m-2; the answer's residual stream at
the positions its tokens are read in, P .. P+m-2 (the last token is never read back while
generating, so a teacher-forced pass stops there too)."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import torch

READ_DEPTHS = (0.5, 0.6, 0.7, 0.8, 0.9)  # candidate layers, as a share of the depth
HIDDEN_AT = ("last_prompt", "first_answer", "answer_mean")


def read_layers(num_layers: int) -> tuple[int, ...]:
    return tuple(sorted({min(num_layers - 1, round(f * num_layers)) for f in READ_DEPTHS}))


@dataclass(frozen=True, slots=True)
class AnswerReadout:
    """One answer's readout. hidden (3, layers, width): HIDDEN_AT rows at `layers`; lookback
    and entropy (num_layers, heads): means over the answer's queries (zeros without one)."""

    layers: tuple[int, ...]
    hidden: torch.Tensor
    lookback: torch.Tensor
    entropy: torch.Tensor

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, the tensors as base64 float16 (a readout is about 20 kB so)."""
        return {
            "layers": list(self.layers),
            **{name: _pack(getattr(self, name)) for name in ("hidden", "lookback", "entropy")},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AnswerReadout:
        tensors = {name: _unpack(data[name]) for name in ("hidden", "lookback", "entropy")}
        return cls(tuple(data["layers"]), **tensors)


class Readout:
    """Accumulates one answer's readout. `limit`: the first position past the answer's last
    query (P+m-1 in a teacher-forced pass; None while generating, where it never comes)."""

    def __init__(
        self, num_layers: int, heads: int, width: int, prompt_len: int, limit: int | None = None
    ) -> None:
        self.prompt_len, self.limit = prompt_len, limit
        self.layers = read_layers(num_layers)
        self._slot = {layer: i for i, layer in enumerate(self.layers)}
        self.hidden = torch.zeros(3, len(self.layers), width, dtype=torch.float64)
        self.answer_rows = 0
        self.lookback = torch.zeros(num_layers, heads, dtype=torch.float64)
        self.entropy = torch.zeros(num_layers, heads, dtype=torch.float64)
        self.queries = torch.zeros(num_layers, dtype=torch.float64)
        self.cursor = 0  # position of the first row of the forward call under way (hooks)

    def wants(self, start: int, n: int) -> bool:
        """Whether positions start .. start+n-1 hold anything to read."""
        return start + n > self.prompt_len - 1 and (self.limit is None or start < self.limit)

    def observe_hidden(self, layer: int, rows: torch.Tensor, start: int) -> None:
        """rows (n, width): layer `layer`'s output at positions start ..."""
        slot = self._slot.get(layer)
        if slot is None:
            return
        last = self.prompt_len - 1
        end = (
            start + rows.shape[0] if self.limit is None else min(start + rows.shape[0], self.limit)
        )
        if start <= last < end:
            self.hidden[0, slot] = rows[last - start]
        first = self.prompt_len
        if start <= first < end:
            self.hidden[1, slot] = rows[first - start]
        begin = max(start, first)
        if begin < end:
            self.hidden[2, slot] += rows[begin - start : end - start].sum(0, dtype=torch.float64)
            if slot == 0:
                self.answer_rows += end - begin

    def observe_attention(self, layer: int, probs: torch.Tensor, start: int) -> None:
        """probs (heads, n, keys): attention of the queries at positions start ... over the
        latest `keys` positions, up to the last query's (a sliding-window cache holds only
        those); rows outside the answer's queries are skipped."""
        begin = max(start, self.prompt_len - 1)
        end = start + probs.shape[1]
        first_key = end - probs.shape[2]
        if self.limit is not None:
            end = min(end, self.limit)
        if begin >= end:
            return
        p = probs[:, begin - start : end - start].double()
        on_prompt = p[..., : max(0, self.prompt_len - first_key)].sum(-1)  # (heads, rows)
        entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)
        self.observe_stats(layer, on_prompt.T, entropy.T)

    def observe_stats(self, layer: int, on_prompt: torch.Tensor, entropy: torch.Tensor) -> None:
        """Per query row and head (rows, heads): attention share on the prompt and entropy, as
        a decoder that reduces the probabilities itself reports them."""
        self.lookback[layer] += on_prompt.sum(0, dtype=torch.float64)
        self.entropy[layer] += entropy.sum(0, dtype=torch.float64)
        self.queries[layer] += on_prompt.shape[0]

    def observe_step(self, hidden: torch.Tensor, attention: torch.Tensor, pos: int) -> None:
        """One decode step of every layer at once: hidden (layers, width) each layer's output,
        attention (layers, heads, 2) each head's share on the prompt and entropy, for the
        query at `pos` (the bulk form of `observe_hidden` and `observe_stats`)."""
        if self.limit is not None and pos >= self.limit:
            return
        rows = hidden[list(self.layers)]
        for slot in range(len(self.layers)):
            self.observe_hidden(self.layers[slot], rows[slot : slot + 1], pos)
        if pos >= self.prompt_len - 1:
            self.lookback += attention[..., 0]
            self.entropy += attention[..., 1]
            self.queries += 1

    def result(self) -> AnswerReadout:
        hidden = self.hidden.clone()
        hidden[2] /= max(self.answer_rows, 1)
        queries = self.queries.clamp_min(1)[:, None]
        lookback, entropy = self.lookback / queries, self.entropy / queries
        return AnswerReadout(self.layers, hidden.float(), lookback.float(), entropy.float())


class RowReadouts(Readout):
    """Several answers' readouts behind one batched, right-padded forward pass through the
    hooks (`sparsity.hooks.read_out`), which hand it the whole batch: row b goes to
    readouts[b], cut to its `lengths[b]` real positions (keys too)."""

    def __init__(self, readouts: list[Readout], lengths: list[int]) -> None:
        self.rows, self.lengths = readouts, lengths
        self.cursor = 0

    def wants(self, start: int, n: int) -> bool:
        return any(r.wants(start, n) for r in self.rows)

    def observe_hidden(self, layer: int, rows: torch.Tensor, start: int) -> None:
        batch = rows.reshape(len(self.rows), -1, rows.shape[-1])
        for readout, n, row in zip(self.rows, self.lengths, batch, strict=True):
            if readout.wants(start, n):
                readout.observe_hidden(layer, row[:n], start)

    def observe_attention(self, layer: int, probs: torch.Tensor, start: int) -> None:
        """probs (B, heads, T, T)."""
        for readout, n, row in zip(self.rows, self.lengths, probs, strict=True):
            if readout.wants(start, n):
                readout.observe_attention(layer, row[:, :n, :n], start)


def _pack(t: torch.Tensor) -> dict[str, Any]:
    raw = t.to(torch.float16).contiguous().numpy().tobytes()
    return {"shape": list(t.shape), "f16": base64.b64encode(raw).decode("ascii")}


def _unpack(packed: dict[str, Any]) -> torch.Tensor:
    raw = bytearray(base64.b64decode(packed["f16"]))
    flat = torch.frombuffer(raw, dtype=torch.float16) if raw else torch.zeros(0)
    return flat.float().reshape(packed["shape"])
