"""One split policy for every corpus: the documents in a fixed seeded order; calibration
samples come from the front, held-out text (calibration's quality check) from the back, and
the middle is left for independent evaluation (benchmarks, compression studies)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Encode = Callable[[str], list[int]]


class CorpusTooSmallError(ValueError):
    """A corpus does not hold the samples and held-out tokens asked for."""


def shuffled(texts: list[str], seed: int = 0) -> list[str]:
    """The documents in a fixed pseudo-random order. Shuffling keeps every slice
    representative of the whole corpus: a corpus's last documents are often unlike the rest."""
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(seed)).tolist()
    return [texts[i] for i in order]


def calibration_split(
    encode: Encode,
    texts: list[str],
    *,
    samples: int,
    seq_len: int,
    min_tokens: int,
    heldout_tokens: int,
) -> tuple[list[list[int]], list[int]]:
    """`samples` token sequences (each one document's first `seq_len` tokens, at least
    `min_tokens` long) from the front, and `heldout_tokens` tokens from the back; the two
    never share a document."""
    texts = shuffled(texts)
    heldout: list[int] = []
    back = len(texts)
    while len(heldout) < heldout_tokens and back > 0:
        back -= 1
        heldout = encode(texts[back]) + heldout
    batches = []
    for text in texts[:back]:
        ids = encode(text)[:seq_len]
        if len(ids) >= min_tokens:
            batches.append(ids)
        if len(batches) == samples:
            break
    if len(batches) < samples or len(heldout) < heldout_tokens:
        raise CorpusTooSmallError(
            f"{len(batches)} samples of >= {min_tokens} tokens and {len(heldout)} held-out tokens"
        )
    return batches, heldout[-heldout_tokens:]


def front_documents(texts: list[str], count: int) -> list[str]:
    """Calibration-side documents: the front of the shuffled corpus."""
    return shuffled(texts)[:count]


def evaluation_tokens(tokenizer: Any, texts: list[str], count: int) -> torch.Tensor:
    """`count` tokens from the middle of the shuffled corpus, unseen by calibration."""
    ids: list[int] = []
    texts = shuffled(texts)
    for text in texts[len(texts) // 2 :] or texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(ids) >= count:
            break
    return torch.tensor(ids[:count])
