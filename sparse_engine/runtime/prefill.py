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
        cached, mismatch = self._restore(ids)
        recorder = self.recorder
        logits: torch.Tensor | None = None
        start = cached
        for end in (e for e in ends if e > cached):
            logits = self.path.forward(ids[start:end])
            start = end
            if self.store is not None:
                signals = recorder.prefix if recorder is not None else None
                self.store.store(self.key, ids[:end], self.path.copy, signals)
        assert logits is not None, "the last end is the prompt's length"
        return Prefilled(logits, cached, mismatch)

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
