"""One split policy for every corpus: the documents in a fixed seeded order; calibration
samples come from the front, held-out text (calibration's quality check) from the back, and
the middle is left for independent evaluation (benchmarks, compression studies)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

Encode = Callable[[str], list[int]]
T = TypeVar("T")


class CorpusTooSmallError(ValueError):
    """A corpus does not hold the samples and held-out tokens asked for."""


def shuffled(texts: list[T], seed: int = 0) -> list[T]:
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
    heldout_doc_tokens: int = 512,
    sources: Sequence[int] = (),
) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """`samples` token sequences from the front, each one document's first `seq_len` tokens,
    and held-out pieces from the back, each the middle `heldout_doc_tokens` of one document
    (the last cut so that they hold `heldout_tokens` in all); all at least `min_tokens` long,
    and the two never share a document. A window of each of many documents, not one long
    article, makes the held-out text like the corpus, and lets their differences show in the
    standard error; a window each, not shorter pieces, keeps document boundaries (whose tokens
    sparsity barely changes) as rare as in the text the benchmarks score. With `sources` (one
    per text, for a mixed corpus) every source gets an equal share of the held-out tokens, and
    the third list names each held-out piece's source."""
    order = shuffled(list(range(len(texts))))
    labels = [sources[i] for i in order] if sources else [0] * len(texts)
    texts = [texts[i] for i in order]
    kinds = sorted(set(labels))
    share = {
        k: heldout_tokens // len(kinds) + (k == kinds[-1]) * (heldout_tokens % len(kinds))
        for k in kinds
    }
    heldout: list[list[int]] = []
    heldout_sources: list[int] = []
    total, back = 0, len(texts)
    while total < heldout_tokens and back > 0:
        back -= 1
        if share[labels[back]] <= 0:
            continue
        ids = encode(texts[back])
        start = max(0, (len(ids) - heldout_doc_tokens) // 2)
        ids = ids[start : start + heldout_doc_tokens]
        if len(ids) >= min_tokens:
            heldout.append(ids[: share[labels[back]]])
            heldout_sources.append(labels[back])
            share[labels[back]] -= len(heldout[-1])
            total += len(heldout[-1])
    batches = []
    for text in texts[:back]:
        ids = encode(text)[:seq_len]
        if len(ids) >= min_tokens:
            batches.append(ids)
        if len(batches) == samples:
            break
    if len(batches) < samples or total < heldout_tokens:
        raise CorpusTooSmallError(
            f"{len(batches)} samples of >= {min_tokens} tokens and {total} held-out tokens"
        )
    return batches, heldout, heldout_sources


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
