"""Accumulates the per-request signals inside the hooks, with vectorised tensor ops only."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from sparse_engine.sparsity import signals

# Used when no calibration gives per-layer silence thresholds (an uncalibrated dense model).
DEFAULT_SILENCE_THRESHOLD = 1e-2


@dataclass(slots=True)
class SignalSummary:
    sparsity_ratio: float
    sparsity_per_layer: list[float]
    gate_confidence: float
    activation_stability_pct: float
    silence_rate_per_layer: list[float]
    step_sparsity: list[float]
    gate_entropy: float
    # Mean |activation| per MLP channel over the answer's tokens, one row per layer (empty
    # before any answer token): what the trust model's channel probe reads.
    answer_channels: list[torch.Tensor] | None = None


@dataclass(frozen=True, slots=True)
class PrefixSignals:
    """What a recorder summed over a prompt prefix, kept with the prefix's KV so that a request
    reusing the KV gets the signals an uncached prefill would have given it."""

    counts: torch.Tensor  # (layers, 4): zeroed, total, kept-share sum, kept-share tokens
    channels: tuple[torch.Tensor | None, ...]  # per layer, |down-projection input| summed
    tokens: int


class SignalRecorder:
    """Per-layer running sums, one step per forward call. Call `begin_step` before and
    `end_step` after each forward; the first step of a request is its prefill (several forward
    calls inside `one_step` count as one)."""

    def __init__(self, num_layers: int, silence_thresholds: Sequence[float] | None = None) -> None:
        self.num_layers = num_layers
        self.silence_thresholds = list(
            silence_thresholds or [DEFAULT_SILENCE_THRESHOLD] * num_layers
        )
        self.zeros = torch.zeros(num_layers, dtype=torch.float64)
        self.numel = torch.zeros(num_layers, dtype=torch.float64)
        self.kept_share_sum = torch.zeros(num_layers, dtype=torch.float64)
        self.kept_share_tokens = torch.zeros(num_layers, dtype=torch.float64)
        self.magnitude: list[torch.Tensor | None] = [None] * num_layers
        self.silence_tokens = 0
        # Answer positions: every step after the first (the prefill) when generating, or the
        # positions from `answer_start` on in one teacher-forced pass.
        self.answer_magnitude: list[torch.Tensor | None] = [None] * num_layers
        self.answer_tokens = 0
        self.answer_start: int | None = None
        self.token_zeros: torch.Tensor | None = None  # per position, for a single-pass score
        self.token_width = 0.0
        self.step_sparsity: list[float] = []
        self.steps = 0
        self._step_start = (0.0, 0.0)
        self._blocks: list[torch.Tensor | None] = [None, None]  # see observe_layers
        self._held = False

    def track_positions(self, num_positions: int) -> None:
        """Also count zeros per position, for one forward pass over a whole sequence."""
        self.token_zeros = torch.zeros(num_positions, dtype=torch.float64)
        self.token_width = 0.0

    def position_sparsity(self) -> list[float]:
        if self.token_zeros is None or not self.token_width:
            return []
        return list((self.token_zeros / self.token_width).tolist())

    @contextmanager
    def one_step(self) -> Iterator[None]:
        """Forward calls (and `credit`) inside count as a single step: a prefill in parts."""
        self.begin_step()
        self._held = True
        try:
            yield
        finally:
            self._held = False
            self.end_step()

    def begin_step(self) -> None:
        if not self._held:
            self._step_start = (float(self.zeros.sum()), float(self.numel.sum()))

    def end_step(self) -> None:
        if self._held:
            return
        self.steps += 1
        zeros = float(self.zeros.sum()) - self._step_start[0]
        numel = float(self.numel.sum()) - self._step_start[1]
        if numel:
            self.step_sparsity.append(zeros / numel)

    def observe_sparsified(
        self,
        layer: int,
        magnitude: torch.Tensor,
        kept: torch.Tensor,
        share: torch.Tensor | None = None,
    ) -> None:
        """Record one sparsified tensor: `magnitude` is |input|, `kept` the boolean keep mask,
        `share` each token's gate confidence where the sparsifier defines its own (learned
        gates); by default the kept share of |activation|."""
        self.numel[layer] += magnitude.numel()
        self.zeros[layer] += magnitude.numel() - kept.sum()
        if self.token_zeros is not None:
            self.token_zeros += (~kept).reshape(-1, kept.shape[-1]).sum(-1)
            self.token_width += kept.shape[-1]
        if share is None:
            share = signals.kept_magnitude_share(magnitude, kept)
        self.kept_share_sum[layer] += share.sum()
        self.kept_share_tokens[layer] += share.numel()

    def observe_channels(self, layer: int, magnitude: torch.Tensor) -> None:
        """Record MLP channel activity: |input| of the down projection, before sparsity."""
        flat = magnitude.reshape(-1, magnitude.shape[-1])
        self.magnitude[layer] = _add(self.magnitude[layer], flat.sum(0, dtype=torch.float64))
        answer = flat[self.answer_start :] if self.answer_start is not None else flat
        if self.answer_start is not None or self.steps:
            self.answer_magnitude[layer] = _add(
                self.answer_magnitude[layer], answer.sum(0, dtype=torch.float64)
            )
            if layer == 0:
                self.answer_tokens += answer.shape[0]
        if layer == 0:
            self.silence_tokens += flat.shape[0]

    def observe_layers(self, counts: torch.Tensor, channels: torch.Tensor, positions: int) -> None:
        """Record one forward step of every layer at once: the bulk form of
        `observe_sparsified` and `observe_channels` for a decoder that sums per layer itself.
        `counts` (layers, 4) holds zeroed and total sparsified activations and the kept-magnitude
        share summed over tokens and their number; `channels` (layers, width) each layer's
        |down-projection input| summed over the step's `positions`."""
        if self.token_zeros is not None or self.answer_start is not None:
            raise ValueError("per-position and teacher-forced signals need the hooks")
        counts = counts.to(torch.float64)
        self.zeros += counts[:, 0]
        self.numel += counts[:, 1]
        self.kept_share_sum += counts[:, 2]
        self.kept_share_tokens += counts[:, 3]
        channels = channels.to("cpu", torch.float64)
        self._blocks[0] = _add_rows(self.magnitude, channels, self._blocks[0])
        if self.steps:
            self._blocks[1] = _add_rows(self.answer_magnitude, channels, self._blocks[1])
            self.answer_tokens += positions
        self.silence_tokens += positions

    def prefix(self) -> PrefixSignals:
        """The sums so far, which must all be prompt positions (call before the first decode)."""
        if self.steps or self.answer_start is not None or self.token_zeros is not None:
            raise ValueError("a prefix's signals are taken during the prefill")
        counts = torch.stack([self.zeros, self.numel, self.kept_share_sum, self.kept_share_tokens])
        channels = tuple(None if m is None else m.clone() for m in self.magnitude)
        return PrefixSignals(counts.T.clone(), channels, self.silence_tokens)

    def credit(self, prefix: PrefixSignals) -> None:
        """Add a cached prefix's sums, as if its positions had been run through the hooks."""
        if self.steps or self._blocks[0] is not None:
            raise ValueError("credit a cached prefix before anything else is recorded")
        for total, column in zip(
            (self.zeros, self.numel, self.kept_share_sum, self.kept_share_tokens),
            prefix.counts.T,
            strict=True,
        ):
            total += column
        for i, row in enumerate(prefix.channels):
            if row is not None:
                self.magnitude[i] = _add(self.magnitude[i], row.clone())
        self.silence_tokens += prefix.tokens

    def summary(self) -> SignalSummary:
        per_layer = [
            signals.zeroed_fraction(float(z), float(n))
            for z, n in zip(self.zeros, self.numel, strict=True)
        ]
        sparsified = self.kept_share_tokens > 0
        confidence = self.kept_share_sum[sparsified] / self.kept_share_tokens[sparsified]
        decode_steps = self.step_sparsity[1:]
        return SignalSummary(
            sparsity_ratio=signals.zeroed_fraction(
                float(self.zeros.sum()), float(self.numel.sum())
            ),
            sparsity_per_layer=per_layer,
            gate_confidence=float(confidence.mean()) if confidence.numel() else 1.0,
            activation_stability_pct=signals.coefficient_of_variation_pct(decode_steps),
            silence_rate_per_layer=self._silence_rates(),
            step_sparsity=list(self.step_sparsity),
            gate_entropy=self._gate_entropy(),
            answer_channels=self._answer_channels(),
        )

    def _answer_channels(self) -> list[torch.Tensor] | None:
        if not self.answer_tokens:
            return None
        return [
            (m / self.answer_tokens).float() if m is not None else torch.zeros(0)
            for m in self.answer_magnitude
        ]

    def _silence_rates(self) -> list[float]:
        tokens = max(self.silence_tokens, 1)
        return [
            0.0 if total is None else signals.silence_rate(total / tokens, threshold)
            for total, threshold in zip(self.magnitude, self.silence_thresholds, strict=True)
        ]

    def _gate_entropy(self) -> float:
        values = [signals.normalised_entropy(m) for m in self.magnitude if m is not None]
        return sum(values) / len(values) if values else 0.0


class RowRecorders(SignalRecorder):
    """Several requests' recorders behind one batched forward pass through the hooks: row b of
    each (B, T, width) tensor goes to recorders[b], cut to its `lengths[b]` real positions
    (the batch is right-padded)."""

    def __init__(self, recorders: Sequence[SignalRecorder], lengths: Sequence[int]) -> None:
        super().__init__(recorders[0].num_layers)
        self.rows, self.lengths = list(recorders), list(lengths)

    def begin_step(self) -> None:
        for recorder in self.rows:
            recorder.begin_step()

    def end_step(self) -> None:
        for recorder in self.rows:
            recorder.end_step()

    def observe_sparsified(
        self,
        layer: int,
        magnitude: torch.Tensor,
        kept: torch.Tensor,
        share: torch.Tensor | None = None,
    ) -> None:
        shares = share if share is not None else [None] * len(self.rows)
        rows = zip(self.rows, self.lengths, magnitude, kept, shares, strict=True)
        for recorder, n, m, k, s in rows:
            recorder.observe_sparsified(layer, m[:n], k[:n], None if s is None else s[:n])

    def observe_channels(self, layer: int, magnitude: torch.Tensor) -> None:
        for recorder, n, m in zip(self.rows, self.lengths, magnitude, strict=True):
            recorder.observe_channels(layer, m[:n])


@dataclass(slots=True)
class LayerCounts:
    """Per-layer sums over one step's sparsified tensors, as `observe_sparsified` keeps them:
    zeroed and total activations, and the kept-magnitude share summed over tokens."""

    zeros: list[float]
    numel: list[float]
    kept_share_sum: list[float]
    kept_share_tokens: list[float]

    @classmethod
    def empty(cls, num_layers: int) -> LayerCounts:
        return cls(*([0.0] * num_layers for _ in range(4)))

    def tensor(self) -> torch.Tensor:
        """(layers, 4), as `SignalRecorder.observe_layers` takes them."""
        columns = (self.zeros, self.numel, self.kept_share_sum, self.kept_share_tokens)
        return torch.tensor(columns, dtype=torch.float64).T

    def add(self, layer: int, numel: int, kept: int, share_sum: float, tokens: int) -> None:
        """A sparsified tensor of `numel` activations over `tokens` tokens, `kept` of them
        kept, whose per-token kept-magnitude shares sum to `share_sum`."""
        self.zeros[layer] += numel - kept
        self.numel[layer] += numel
        self.kept_share_sum[layer] += share_sum
        self.kept_share_tokens[layer] += tokens


def _add(total: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    return value if total is None else total.add_(value)


def _add_rows(
    totals: list[torch.Tensor | None], block: torch.Tensor, rows_of: torch.Tensor | None
) -> torch.Tensor:
    """totals[i] += block[i] for every layer. The first call makes the totals rows of one new
    block (returned; pass it back as `rows_of`), so later steps add in one operation."""
    if rows_of is not None:
        return rows_of.add_(block)
    rows_of = block.clone()
    for i, row in enumerate(rows_of.unbind(0)):
        total = totals[i]
        if total is not None:
            row.add_(total)
        totals[i] = row
    return rows_of
