"""Reuse of prompt KV caches across requests that share a prefix (system prompt, earlier turns).
KV values depend on the sparsity plan, so an entry is bound to the model, the calibration
version and the level that built it and is never reused under another.

An entry also keeps what the signal recorder summed over its tokens, so a request that reuses it
reports the signals of an uncached prefill. That is exact only for a whole entry, so entries are
stored where a reusable prefix ends (`Engine` stores the prompt without its last message, and
the whole prompt) and a lookup reuses an entry only when all of it is a prefix of the prompt."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from sparse_engine.sparsity.recorder import PrefixSignals

KV = TypeVar("KV")


class SparseCacheMismatchError(RuntimeError):
    """The longest cached prefix was built under another calibration version or level."""


@dataclass(frozen=True, slots=True)
class CacheKey:
    model_id: str
    calibration_version: str | None
    level: str


@dataclass(slots=True)
class Entry(Generic[KV]):
    key: CacheKey
    tokens: tuple[int, ...]
    kv: KV
    signals: PrefixSignals | None  # None when the request that built it recorded none


class PrefixCache(Generic[KV]):
    """LRU of prompt prefixes' KV, bounded by the total number of cached tokens."""

    def __init__(self, max_tokens: int = 8192, min_reuse: int = 16) -> None:
        self.max_tokens = max_tokens
        self.min_reuse = min_reuse
        self._entries: OrderedDict[int, Entry[KV]] = OrderedDict()
        self._next_id = 0
        self.mismatches = 0

    def lookup(self, key: CacheKey, tokens: list[int], signals: bool = False) -> Entry[KV] | None:
        """The longest entry that is a prefix of `tokens` (at most all but the last token,
        which must be fed to get logits), with recorded signals when `signals`; None on a miss.
        The entry is shared: copy its KV before writing to it. Raises
        SparseCacheMismatchError when the best prefix belongs to another key."""
        best_id, best = None, (0, False)
        prompt = tuple(tokens)
        for entry_id, entry in self._entries.items():
            n = len(entry.tokens)
            if n >= len(prompt) or (signals and entry.signals is None):
                continue
            if (n, entry.key == key) > best and prompt[:n] == entry.tokens:
                best_id, best = entry_id, (n, entry.key == key)
        if best_id is None:
            return None
        if not best[1]:
            self.mismatches += 1
            found = self._entries[best_id]
            raise SparseCacheMismatchError(
                f"cached prefix of {best[0]} tokens was built under {found.key}, not {key}"
            )
        self._entries.move_to_end(best_id)
        return self._entries[best_id]

    def store(
        self,
        key: CacheKey,
        tokens: list[int],
        kv: Callable[[], KV],
        signals: Callable[[], PrefixSignals] | None = None,
    ) -> None:
        """Keep the KV of exactly `tokens`; `kv` (and `signals`) make copies, called only when
        the entry is new and within bounds."""
        if len(tokens) < self.min_reuse or len(tokens) > self.max_tokens:
            return
        prefix = tuple(tokens)
        for entry_id, entry in list(self._entries.items()):
            if entry.key == key and entry.tokens == prefix:
                if entry.signals is None and signals is not None:
                    entry.signals = signals()
                self._entries.move_to_end(entry_id)
                return
        self._entries[self._next_id] = Entry(key, prefix, kv(), signals() if signals else None)
        self._next_id += 1
        while sum(len(e.tokens) for e in self._entries.values()) > self.max_tokens:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)
