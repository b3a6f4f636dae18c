"""Several prompts' prefills as one pass: the tokens of the prompts that start at one step
boundary packed into one (N, width) input, so the fast path's weights are read once for all of
them instead of once per prompt (a short prompt's prefill is mostly that read: `sparseguard
bench batch-step` times both). Every product is token-wise, each token masked at its own
sequence's thresholds (`batch._project`); attention runs prompt by prompt over its own KV slot
with the code a prefill alone runs (`FastDecoder._attention`), so no prompt sees another; each
prompt's signals and readout are summed over its own tokens and recorded as its prefill alone
records them. `prefill_sequences` is the scheduler's way in: each sequence's cached prefix and
earlier parts first, alone, then the last parts of all of them packed."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass

import torch

from sparse_engine.runtime.batch import KVSlots, _project, _Tally
from sparse_engine.runtime.engine import Engine
from sparse_engine.runtime.prefill import FastKV, OpenPrefill
from sparse_engine.runtime.sequence import Sequence
from sparse_engine.sparsity.readout import Readout
from sparse_engine.sparsity.recorder import SignalRecorder

log = logging.getLogger(__name__)
Started = tuple[int, FastKV, torch.Tensor, torch.Tensor]  # index, KV path, thresholds, logits
Opened = tuple[int, OpenPrefill, "Segment"]
# Tokens one packed pass takes: from about 128 tokens a prefill's products are compute-bound
# (`sparseguard bench batch-step`), so larger passes gain little speed and hold more memory
# (32 prompts, ~2300 tokens, in one pass: 90-290 MB more peak RSS than one by one).
PACKED_TOKENS = 1024


@dataclass(slots=True)
class Segment:
    """One prompt's part of a packed prefill: `ids` go to positions `start` ... of `slot`,
    whose first `start` positions already hold its restored prefix."""

    slot: int
    start: int
    ids: list[int]
    limits: torch.Tensor  # (layers, roles) float64, -1 where the role is dense
    recorder: SignalRecorder | None
    readout: Readout | None


@torch.inference_mode()
def prefill_packed(slots: KVSlots, segments: list[Segment]) -> torch.Tensor:
    """Logits (S, vocab) of each segment's last position, its keys and values written to its
    slot. The fast decoder is left bound to the last segment's slot: `unbind` it after."""
    fast = slots.fast
    for seg in segments:
        if not seg.ids:
            raise ValueError("a packed prefill segment needs at least one token")
        if seg.start + len(seg.ids) > fast.max_len:
            raise ValueError(f"the sequence would exceed the fast path's {fast.max_len} tokens")
    sizes = torch.tensor([len(seg.ids) for seg in segments])
    ends = sizes.cumsum(0).tolist()
    spans = list(zip([0, *ends[:-1]], ends, strict=True))
    owner = torch.repeat_interleave(torch.arange(len(segments)), sizes)  # token -> segment
    x = fast._embed(torch.tensor([t for seg in segments for t in seg.ids], device=fast.device))
    limits = torch.stack([seg.limits for seg in segments]).to(torch.float32)  # (S, layers, roles)
    sparse = (limits >= 0).any(0).tolist()
    per_token = limits[owner]
    for seg, (a, _) in zip(segments, spans, strict=True):
        if seg.start == 0:  # position 0, the attention sink, stays dense (`sparsity.sink`)
            per_token[a] = per_token[a].clamp(max=0.0)
    layers, n = len(fast.layers), x.shape[0]
    recording = any(seg.recorder is not None for seg in segments)
    channels = torch.zeros(len(segments), layers, fast.channels.shape[1])
    tally = _Tally()
    for i, layer in enumerate(fast.layers):
        lim = per_token[:, i]
        h = fast._norm(x, layer.attn_norm)
        qkv = _project(layer.qkv, h, lim, sparse[i], tally, i)
        parts = []
        for seg, (a, b) in zip(segments, spans, strict=True):
            fast.bind(slots.keys[:, seg.slot], slots.values[:, seg.slot], seg.start)
            parts.append(fast._attention(i, qkv[a:b], seg.start, seg.readout))
        o = _project(layer.o, torch.cat(parts), lim, sparse[i], tally, i)
        x = x + fast._norm(o, layer.post_attn_norm)
        h = fast._norm(x, layer.mlp_norm)
        gate, up = _project(layer.gate_up, h, lim, sparse[i], tally, i).chunk(2, dim=-1)
        a = fast._activation(gate) * up
        if recording:
            channels[:, i].index_add_(0, owner, a.abs())
        down = _project(layer.down, a, lim, sparse[i], tally, i)
        x = x + fast._norm(down, layer.post_mlp_norm)
        for seg, (a, b) in zip(segments, spans, strict=True):
            if seg.readout is not None and seg.readout.wants(seg.start, b - a):
                seg.readout.observe_hidden(i, x[a:b], seg.start)
    if recording:
        counts = torch.zeros(len(segments), layers, 4, dtype=torch.float64)
        counts.index_add_(0, owner, tally.counts(n, layers))
        for s, seg in enumerate(segments):
            if seg.recorder is not None:
                seg.recorder.begin_step()
                seg.recorder.observe_layers(counts[s], channels[s], len(seg.ids))
                seg.recorder.end_step()
    last = x[torch.tensor(ends) - 1]
    return fast.head.product(fast._norm(last, fast.norm))


def prefill_sequences(
    engine: Engine,
    slots: KVSlots,
    first: int,
    seqs: list[Sequence],
    failed: Callable[[int, Exception], None],
) -> list[Started]:
    """Prefill fast-path sequences into slots `first`, `first` + 1, ...: each one's cached
    prefix restored and earlier parts run alone (`Engine.open_prefill`), then the last parts
    packed, PACKED_TOKENS tokens a pass at most. Per sequence that started: its index in
    `seqs`, KV path, threshold table and first logits (`seq.prefilled` set); `failed(index,
    error)` for the others."""
    fast = engine.fast
    assert fast is not None, "packed prefills run on the fast path"
    opened: list[Opened] = []
    started: list[Started] = []
    with ExitStack() as stack, torch.inference_mode():
        for index, seq in enumerate(seqs):
            slot = first + len(opened)
            try:
                slots.bind(slot, 0)
                part = engine.open_prefill(seq, stack)
                limits = fast._thresholds(seq.plan)
            except Exception as exc:
                failed(index, exc)
                continue
            finally:
                fast.unbind()
            ids = seq.prompt_ids[part.start :]
            opened.append(
                (index, part, Segment(slot, part.start, ids, limits, seq.recorder, seq.readout))
            )
        passes = _passes(opened)
        for done, group in enumerate(passes):
            closed: list[Started] = []
            try:
                logits = prefill_packed(slots, [seg for *_, seg in group])
                for (index, part, seg), row in zip(group, logits, strict=True):
                    seq = seqs[index]
                    slots.bind(seg.slot, len(seq.prompt_ids))
                    seq.prefilled = part.close(seq.prompt_ids, row)
                    closed.append((index, part.path, seg.limits, row))
            except Exception as exc:  # this pass and the later ones fail: no slot left empty
                log.error("a packed prefill failed", exc_info=exc)
                for index, *_ in (item for rest in passes[done:] for item in rest):
                    failed(index, exc)
                return started
            finally:
                fast.unbind()
            started += closed
    return started


def _passes(opened: list[Opened]) -> list[list[Opened]]:
    """Consecutive groups of at most PACKED_TOKENS tokens (a longer prompt alone)."""
    groups: list[list[Opened]] = []
    size = 0
    for item in opened:
        n = len(item[2].ids)
        if groups and size + n <= PACKED_TOKENS:
            groups[-1].append(item)
            size += n
        else:
            groups.append([item])
            size = n
    return groups
