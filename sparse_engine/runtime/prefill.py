"""A prompt's prefill with prefix reuse, on either decode path: the longest cached prefix is
restored (KV and the signals recorded over it), the rest is run in parts that end where a
reusable prefix ends, and each such prefix is stored for later requests."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch
from transformers import DynamicCache

from sparse_engine.runtime.fastpath import FastDecoder
from sparse_engine.runtime.prefix_cache import CacheKey, PrefixCache, SparseCacheMismatchError
from sparse_engine.sparsity.plan import SparsityPlan
from sparse_engine.sparsity.readout import Readout
from sparse_engine.sparsity.recorder import SignalRecorder

KV = TypeVar("KV")


class PromptKV(Protocol[KV]):
    """A decode path's KV cache as the prefill sees it."""

    def forward(self, ids: list[int]) -> torch.Tensor: ...  # logits of the last position
    def copy(self) -> KV: ...  # the KV of every position so far
    def restore(self, kv: KV, tokens: tuple[int, ...]) -> None: ...


@dataclass(slots=True)
class Prefilled:
    logits: torch.Tensor
    cached: int  # prompt tokens whose KV was reused
    mismatch: bool  # the longest cached prefix was another version's or level's


@dataclass(slots=True)
class Prefill(Generic[KV]):
    path: PromptKV[KV]
    store: PrefixCache[KV] | None
    key: CacheKey
    recorder: SignalRecorder | None

    def run(self, ids: list[int], ends: list[int]) -> Prefilled:
        """Prefill `ids`; `ends` are the lengths of its reusable prefixes (the last is
        len(ids)). Signals of the whole prompt are recorded as one step."""
        cached, mismatch, start = self.begin(ids, ends)
        logits = self.path.forward(ids[start:])
        self.end(ids)
        return Prefilled(logits, cached, mismatch)

    def begin(self, ids: list[int], ends: list[int]) -> tuple[int, bool, int]:
        """Restore the longest cached prefix and run every part but the last (another pass
        may run that one: `runtime.packed`, then `end`). Returns the tokens reused, whether
        the longest cached prefix was another version's or level's, and where the last part
        starts."""
        cached, mismatch = self._restore(ids)
        start = cached
        for end in (e for e in ends[:-1] if cached < e < len(ids)):
            self.path.forward(ids[start:end])
            start = end
            self._store(ids[:end])
        return cached, mismatch, start

    def end(self, ids: list[int]) -> None:
        """The whole prompt has run: store it for later requests."""
        self._store(ids)

    def _store(self, prefix: list[int]) -> None:
        if self.store is not None:
            signals = self.recorder.prefix if self.recorder is not None else None
            self.store.store(self.key, prefix, self.path.copy, signals)

    def _restore(self, ids: list[int]) -> tuple[int, bool]:
        if self.store is None:
            return 0, False
        try:
            entry = self.store.lookup(self.key, ids, signals=self.recorder is not None)
        except SparseCacheMismatchError:
            return 0, True
        if entry is None:
            return 0, False
        self.path.restore(entry.kv, entry.tokens)
        if self.recorder is not None and entry.signals is not None:
            self.recorder.credit(entry.signals)
        return len(entry.tokens), False


@dataclass(slots=True)
class OpenPrefill:
    """A fast-path prefill run but for its last part, positions `start` ... of the prompt
    (`Engine.open_prefill`); `close` with that part's logits once another pass ran it."""

    path: FastKV
    prefill: Prefill[FastKVState]
    cached: int
    mismatch: bool
    start: int

    def close(self, ids: list[int], logits: torch.Tensor) -> Prefilled:
        """Store the whole prompt `ids` for later requests (the fast decoder bound to its KV,
        `ids` long) and give what `Prefill.run` gives."""
        self.prefill.end(ids)
        return Prefilled(logits, self.cached, self.mismatch)


class ReferenceKV:
    """The Hugging Face path: a DynamicCache, run through the engine's forward. A readout's
    hooks (`sparsity.hooks.read_out`) learn each call's first position from it."""

    def __init__(
        self, engine: Any, recorder: SignalRecorder | None, readout: Readout | None = None
    ) -> None:
        self.engine, self.recorder, self.readout = engine, recorder, readout
        self.cache = DynamicCache(config=engine.lm.model.config)
        self.length = 0

    def forward(self, ids: list[int]) -> torch.Tensor:
        if self.readout is not None:
            self.readout.cursor = self.length
        logits: torch.Tensor = self.engine._forward(torch.tensor([ids]), self.cache, self.recorder)
        self.length += len(ids)
        return logits

    def copy(self) -> DynamicCache:
        return copy.deepcopy(self.cache)

    def restore(self, kv: DynamicCache, tokens: tuple[int, ...]) -> None:
        self.cache = copy.deepcopy(kv)
        self.length = len(tokens)


FastKVState = tuple[torch.Tensor, torch.Tensor]  # keys, values: (layers, kv heads, n, head dim)


class FastKV:
    """The fast decoder's preallocated buffers."""

    def __init__(
        self,
        fast: FastDecoder,
        plan: SparsityPlan,
        recorder: SignalRecorder | None,
        readout: Readout | None = None,
    ):
        self.fast, self.plan, self.recorder, self.readout = fast, plan, recorder, readout
        fast.reset()

    def forward(self, ids: list[int]) -> torch.Tensor:
        return self.fast.prefill(ids, self.plan, self.recorder, self.readout)

    def step(self, token: int) -> torch.Tensor:
        return self.fast.step(token, self.plan, self.recorder, self.readout)

    def copy(self) -> FastKVState:
        n = self.fast.length
        return self.fast.keys[:, :, :n].clone(), self.fast.values[:, :, :n].clone()

    def restore(self, kv: FastKVState, tokens: tuple[int, ...]) -> None:
        keys, values = kv
        n = len(tokens)
        self.fast.keys[:, :, :n].copy_(keys)
        self.fast.values[:, :, :n].copy_(values)
        self.fast.length, self.fast.tokens = n, list(tokens)
