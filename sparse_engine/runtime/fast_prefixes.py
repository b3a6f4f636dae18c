"""Earlier sequences of the fast decoder, kept so that a request can reuse the KV of a prefix it
shares with any of them, not only with the sequence still in the decoder's buffers: traffic
that interleaves a shared system prompt with other prompts would otherwise reuse only the few
tokens of chat template it shares with the request just before. The KV of a prefix depends on
the plan it was computed under, so a snapshot is reused only under that same plan object."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from sparse_engine.sparsity.plan import SparsityPlan


@dataclass(slots=True)
class Snapshot:
    plan: SparsityPlan
    tokens: tuple[int, ...]
    keys: torch.Tensor  # (layers, kv heads, len(tokens), head dim)
    values: torch.Tensor


class PrefixSnapshots:
    """LRU of sequences and their KV, bounded by the total number of tokens kept. A prefix
    shorter than `min_reuse` tokens is not worth a copy (the chat template's first tokens)."""

    def __init__(self, max_tokens: int = 4096, min_reuse: int = 16) -> None:
        self.max_tokens = max_tokens
        self.min_reuse = min_reuse
        self._kept: OrderedDict[tuple[int, ...], Snapshot] = OrderedDict()

    def best(self, ids: list[int], plan: SparsityPlan) -> tuple[Snapshot | None, int]:
        """The snapshot sharing the longest prefix with `ids` under `plan`, and its length
        (None, 0 below `min_reuse`)."""
        found, length = None, 0
        for snap in self._kept.values():
            if snap.plan is plan:
                n = _common(snap.tokens, ids)
                if n > length:
                    found, length = snap, n
        if found is None or length < self.min_reuse:
            return None, 0
        self._kept.move_to_end(found.tokens)
        return found, length

    def keep(
        self, plan: SparsityPlan, tokens: list[int], keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Copy the KV of `tokens` (positions 0..len-1 of `keys` and `values`)."""
        n = len(tokens)
        if n < self.min_reuse or n > self.max_tokens:
            return
        key = tuple(tokens)
        if key in self._kept and self._kept[key].plan is plan:
            self._kept.move_to_end(key)
            return
        self._kept[key] = Snapshot(plan, key, keys[:, :, :n].clone(), values[:, :, :n].clone())
        while sum(len(s.tokens) for s in self._kept.values()) > self.max_tokens:
            self._kept.popitem(last=False)

    def __len__(self) -> int:
        return len(self._kept)


def _common(a: tuple[int, ...], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
