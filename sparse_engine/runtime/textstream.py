"""Incremental detokenisation for streaming."""

from __future__ import annotations

from typing import Any


class TextStream:
    """Incremental detokenisation that never splits a character or emits a stop string."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.emitted = 0
        self.text = ""

    def push(self, ids: list[int]) -> tuple[str, bool]:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        for s in self.stop:
            cut = text.find(s)
            if cut >= 0:
                self.text = text[:cut]
                return self._take(len(self.text)), True
        self.text = text
        if text.endswith("\ufffd"):
            return "", False
        return self._take(len(text) - self.holdback), False

    def flush(self) -> str:
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
