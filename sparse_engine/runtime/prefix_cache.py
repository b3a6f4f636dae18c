"""Reuse of prompt KV caches across requests that share a prefix (system prompt, few-shot
block). KV values depend on the sparsity plan, so an entry is bound to the model, the
calibration version and the level that built it and is never reused under another."""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass

from transformers import DynamicCache


class SparseCacheMismatchError(RuntimeError):
    """The longest cached prefix was built under another calibration version or level."""


@dataclass(frozen=True, slots=True)
class CacheKey:
    model_id: str
    calibration_version: str | None
    level: str


@dataclass(slots=True)
class _Entry:
    key: CacheKey
    tokens: tuple[int, ...]
    cache: DynamicCache


class PrefixCache:
    """LRU of prompt KV caches, bounded by the total number of cached tokens."""

    def __init__(self, max_tokens: int = 8192, min_reuse: int = 16) -> None:
        self.max_tokens = max_tokens
        self.min_reuse = min_reuse
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next_id = 0
        self.mismatches = 0

    def lookup(self, key: CacheKey, tokens: list[int]) -> tuple[DynamicCache | None, int]:
        """A private copy of the cache for the longest shared prefix (at most all but the last
        token, which must be fed to get logits) and its length; (None, 0) on a miss. Raises
        SparseCacheMismatchError when the best prefix belongs to another key."""
        best_id, best_len, best_key = None, 0, None
        for entry_id, entry in self._entries.items():
            n = _common_prefix(entry.tokens, tokens, len(tokens) - 1)
            if (n, entry.key == key) > (best_len, best_key == key):
                best_id, best_len, best_key = entry_id, n, entry.key
        if best_id is None or best_len < self.min_reuse:
            return None, 0
        if best_key != key:
            self.mismatches += 1
            raise SparseCacheMismatchError(
                f"cached prefix of {best_len} tokens was built under {best_key}, not {key}"
            )
        self._entries.move_to_end(best_id)
        cache = copy.deepcopy(self._entries[best_id].cache)
        surplus = cache.get_seq_length() - best_len
        if surplus:
            cache.crop(-surplus)  # a negative count removes that many trailing tokens
        return cache, best_len

    def store(self, key: CacheKey, tokens: list[int], cache: DynamicCache) -> None:
        """Keep a copy of `cache`, which must hold exactly `tokens`."""
        if len(tokens) < self.min_reuse or len(tokens) > self.max_tokens:
            return
        for entry_id, entry in list(self._entries.items()):
            if entry.key == key and entry.tokens == tuple(tokens):
                self._entries.move_to_end(entry_id)
                return
        self._entries[self._next_id] = _Entry(key, tuple(tokens), copy.deepcopy(cache))
        self._next_id += 1
        while sum(len(e.tokens) for e in self._entries.values()) > self.max_tokens:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


def _common_prefix(a: tuple[int, ...], b: list[int], limit: int) -> int:
    n = 0
    for x, y in zip(a, b[:limit], strict=False):
        if x != y:
            break
        n += 1
    return n
